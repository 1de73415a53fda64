"""Reading the fields of a JSON request: each bad value is a :class:`RequestError` whose one-line
message names the field (the server answers it with HTTP 400)."""

from __future__ import annotations

import math


class RequestError(ValueError):
    """A bad request; its message is the whole answer, with HTTP ``status``."""

    status = 400
    param: str | None = None
    """The field at fault (OpenAI's ``error.param``), where the message's first word is not it."""


class UnknownModel(RequestError):
    """A request naming a model this server does not serve (vLLM's answer: 404)."""

    status = 404
    param = "model"


def check_fields(body, known: set[str], unsupported: dict[str, str] | None = None) -> None:
    """``body`` is a JSON object whose fields are all ``known``; an ``unsupported`` field is
    refused with its reason (a field this server does not implement is never silently ignored)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    for name in body:
        if unsupported and name in unsupported:
            raise RequestError(unsupported[name])
        if name not in known:
            raise RequestError(f"unknown field {name!r}; the fields are {', '.join(sorted(known))}")


def tokenize_field(tokenizer, text: str, name: str) -> list[int]:
    """``tokenizer.tokenize(text)``; a text the tokenizer cannot take (NullTokenizer reads only
    space-separated token ids) is a RequestError naming the field ``name`` and what it holds."""
    try:
        return tokenizer.tokenize(text)
    except ValueError as err:
        shown = repr(text) if len(text) <= 40 else repr(text[:37]) + "..."
        raise RequestError(f"{name}: {err}, got {shown}") from None


def get_bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be a boolean (true or false), got {value!r}")
    return value


def get_int(body: dict, name: str, default, low=None, high=None):
    value = body.get(name, default)
    if value is None and default is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise RequestError(f"{name} must be an integer, got {value!r}")
    _check_range(name, value, low, high)
    return value


def get_number(body: dict, name: str, default: float, low=None, high=None, low_open: bool = False) -> float:
    value = body.get(name, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise RequestError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):  # JSON's NaN / Infinity (Python's json reads them): no range holds NaN
        raise RequestError(f"{name} must be a finite number, got {value!r}")
    if low_open and value <= low:
        raise RequestError(f"{name} must be greater than {low}, got {value!r}")
    _check_range(name, value, None if low_open else low, high)
    return float(value)


def _check_range(name, value, low, high) -> None:
    if low is not None and value < low:
        raise RequestError(f"{name} must be at least {low}, got {value!r}")
    if high is not None and value > high:
        raise RequestError(f"{name} must be at most {high}, got {value!r}")
