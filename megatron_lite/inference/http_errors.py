"""The server's error answers, always JSON, never Flask's HTML page, which OpenAI-compatible clients
cannot read (:func:`error_body`): on the OpenAI routes (paths under ``/v1/``) OpenAI's shape
``{"error": {"message", "type", "param", "code"}}``, which OpenAI's and vLLM's clients read the message
from; elsewhere (Megatron's ``PUT /api``, ``/health``, an unknown path) ``{"message": ...}``.

The requests no route handles:

- 404: a path no route serves; the message names the method and path and lists the routes.
- 405: a route asked with a method it does not take; the message names the methods it takes (also
  in the ``Allow`` header).
- 413: a request body over the server's limit (Flask's ``MAX_CONTENT_LENGTH``); the message names it.
- Any other HTTP error Flask or Werkzeug raises keeps its status with its description as the message.
"""

from __future__ import annotations

import re

ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 500: "server_error"}
"""OpenAI's ``error.type`` by HTTP status; any other 4xx (405, 413) is an ``invalid_request_error``."""
_FIELD = re.compile(r"(?:unknown field '([A-Za-z_][\w]*)'|'?([A-Za-z_]\w*(?:\[[^\]]*\])*(?:\.\w+(?:\[[^\]]*\])*)*))")


def error_param(message: str, fields) -> str | None:
    """The request field ``message`` names, as OpenAI's ``error.param``: its first word (quoted or
    not) where that is one of ``fields`` (with its indices: ``prompt[1]``, ``messages[0].content[2]``),
    or the field an "unknown field 'x'" message names; None where it names none."""
    match = _FIELD.match(message)
    if match is None:
        return None
    if match.group(1):
        return match.group(1)
    word = match.group(2)
    return word if re.match(r"\w+", word).group() in fields else None


def error_body(path: str, message: str, status: int, param: str | None = None) -> dict:
    """The JSON answering an error with ``status`` on ``path``: OpenAI's shape on the ``/v1/`` routes
    (``code``: the HTTP status, as vLLM sends it), else ``{"message": ...}``."""
    if not (path + "/").startswith("/v1/"):
        return {"message": message}
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def routes(app) -> list[str]:
    """The routes ``app`` serves, as ``"METHOD /path"``, by path."""
    rules = sorted((r for r in app.url_map.iter_rules() if r.endpoint != "static"), key=lambda r: r.rule)
    return [f"{m} {r.rule}" for r in rules for m in sorted(r.methods - {"HEAD", "OPTIONS"})]


def http_error_message(app, request, err) -> str:
    """The one line answering the HTTP error ``err`` raised for ``request``."""
    from werkzeug.exceptions import MethodNotAllowed, NotFound, RequestEntityTooLarge

    asked = f"{request.method} {request.path}"
    if isinstance(err, NotFound):
        return f"no route {asked}; the routes are {', '.join(routes(app))}"
    if isinstance(err, MethodNotAllowed):
        takes = sorted(set(err.valid_methods or ()) - {"HEAD", "OPTIONS"})
        return f"{request.path} does not take {request.method}; it takes {', '.join(takes)}"
    if isinstance(err, RequestEntityTooLarge) and request.max_content_length is not None:
        limit = request.max_content_length
        size = f" ({request.content_length} bytes)" if request.content_length is not None else ""
        return (f"the request body{size} is larger than the server's limit of {limit} bytes "
                f"({limit / 2**20:g} MiB); send fewer or shorter prompts per request")
    return f"{asked}: {err.name}: {err.description}"


def install_json_errors(app) -> None:
    """Answer every HTTP error of ``app`` (404, 405, ...) with JSON (:func:`error_body`) and its status."""
    from flask import jsonify, request
    from werkzeug.exceptions import HTTPException

    @app.errorhandler(HTTPException)
    def http_error(err):
        response = jsonify(error_body(request.path, http_error_message(app, request, err), err.code))
        response.status_code = err.code
        for name, value in err.get_headers():
            if name.lower() != "content-type":  # the Allow header of a 405
                response.headers[name] = value
        return response
