"""Talk to a running text-generation server from the terminal (Megatron's tools/text_generation_cli.py).

    python tools/text_generation_cli.py localhost:5000

Asks for a prompt and a number of tokens, sends ``PUT /api`` and prints the text (or the server's
message for a bad request). Ctrl-D or an empty prompt line followed by Ctrl-D quits (Ctrl-C too,
exit code 130). Standard library only.
"""

from __future__ import annotations

import http.client
import json
import sys
import urllib.error
import urllib.parse
import urllib.request


def _json(raw: bytes) -> dict:
    """The answer's JSON object; an answer that is not one (a 404 or 500 page, another server) becomes
    ``{"message": ...}`` quoting its start."""
    if not raw.strip():
        return {"message": "the answer is empty"}
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if not isinstance(body, dict):
        return {"message": f"the answer is not a JSON object: {raw[:80].decode(errors='replace')!r}"}
    return body


def put(url: str, body: dict) -> tuple[int, dict]:
    """(HTTP status, JSON body) of ``PUT url`` with ``body``."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="PUT",
                                     headers={"Content-Type": "application/json; charset=UTF-8"})
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, _json(response.read())
    except urllib.error.HTTPError as err:
        return err.code, _json(err.read())


def _refuse(message: str):
    print(f"text_generation_cli.py: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def api_url(address: str) -> str:
    """``http://HOST:PORT/api`` for ``address`` (HOST:PORT, or a URL); exit code 2 with one line for an
    address urllib cannot use (a port that is not a number in [0, 65535], no host, a broken IPv6 one)."""
    url = (address if "://" in address else f"http://{address}").rstrip("/")
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in [0, 65535]
    except ValueError as err:
        _refuse(f"{address!r} is not the server's HOST:PORT ({err})")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        _refuse(f"{address!r} is not the server's HOST:PORT (e.g. localhost:5000)")
    return f"{url}/api"


def main(argv=None, read=input) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv in (["-h"], ["--help"]):
        print(f"usage: text_generation_cli.py HOST:PORT\n\n{__doc__.strip()}")
        return 0
    if len(argv) != 1 or argv[0].startswith("-"):
        _refuse(f"takes one argument, the server's HOST:PORT (got {' '.join(argv) or 'none'})")
    url = api_url(argv[0])
    try:
        return _talk(url, read)
    except KeyboardInterrupt:  # Ctrl-C at a prompt or while waiting for the answer: quit, no traceback
        print(file=sys.stderr)
        return 130


def _talk(url: str, read) -> int:
    """Prompt, send, print, until end of input (0) or a server that cannot be reached (2)."""
    while True:
        try:
            prompt = read("Enter prompt: ")
            count = read("Enter number of tokens to generate: ")
        except EOFError:
            return 0
        try:
            tokens = int(count)
        except ValueError:
            print(f"not a number: {count!r}")
            continue
        try:
            status, body = put(url, {"prompts": [prompt], "tokens_to_generate": tokens})
        except (OSError, http.client.HTTPException) as err:  # URLError, or the server hung up mid-answer
            print(f"error: cannot reach {url} ({getattr(err, 'reason', None) or err})", file=sys.stderr)
            return 2
        ok = status == 200 and isinstance(body.get("text"), list) and body["text"]
        print(f"Megatron Response: {body['text'][0]}" if ok else f"Error {status}: {body.get('message')}")


if __name__ == "__main__":
    sys.exit(main())
