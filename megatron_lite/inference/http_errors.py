"""The server's answers to requests no route handles: every error is JSON ``{"message": ...}``, the
shape of the server's 400s and 500s (see :mod:`.server`), never Flask's HTML page, which
OpenAI-compatible clients cannot read.

- 404: a path no route serves; the message names the method and path and lists the routes.
- 405: a route asked with a method it does not take; the message names the methods it takes (also
  in the ``Allow`` header).
- 413: a request body over the server's limit (Flask's ``MAX_CONTENT_LENGTH``); the message names it.
- Any other HTTP error Flask or Werkzeug raises keeps its status with its description as the message.
"""

from __future__ import annotations


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
    """Answer every HTTP error of ``app`` (404, 405, ...) with JSON ``{"message": ...}`` and its status."""
    from flask import jsonify, request
    from werkzeug.exceptions import HTTPException

    @app.errorhandler(HTTPException)
    def http_error(err):
        response = jsonify(message=http_error_message(app, request, err))
        response.status_code = err.code
        for name, value in err.get_headers():
            if name.lower() != "content-type":  # the Allow header of a 405
                response.headers[name] = value
        return response
