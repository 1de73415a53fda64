"""tools/text_generation_cli.py against a server that does not answer Megatron's JSON (a wrong
address, a 404 or 500 page, another program on the port): one line per answer, no traceback, and
the loop goes on."""

import http.server
import threading

import pytest

from tests.tools import load_tool


class _Handler(http.server.BaseHTTPRequestHandler):
    answers = iter(())

    def do_PUT(self):  # noqa: N802 - the name http.server calls
        self.rfile.read(int(self.headers["Content-Length"]))
        status, body = next(self.answers)
        if status is None:  # hang up without an answer (a server that died mid-request)
            self.close_connection = True
            return
        self.send_response(status)
        self.send_header("Content-Type", "text/html")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    http_server = http.server.HTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=http_server.serve_forever, daemon=True)
    thread.start()
    yield http_server
    http_server.shutdown()
    http_server.server_close()


def test_answers_that_are_not_json_are_one_line_each(server, capsys):
    _Handler.answers = iter([(404, b"<html>Not Found</html>"), (500, b""), (200, b"hello"), (200, b"[1]"),
                             (200, b'{"text": ["5 17 3"]}')])
    typed = iter(["5 17", "1"] * 5)

    def read(_prompt):
        try:
            return next(typed)
        except StopIteration:
            raise EOFError from None

    assert load_tool("text_generation_cli").main([f"127.0.0.1:{server.server_port}"], read=read) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["Error 404: the answer is not a JSON object: '<html>Not Found</html>'",
                   "Error 500: the answer is empty",
                   "Error 200: the answer is not a JSON object: 'hello'",
                   "Error 200: the answer is not a JSON object: '[1]'",
                   "Megatron Response: 5 17 3"]


@pytest.mark.parametrize("address", ["localhost:abc", "localhost:99999", "http://[::1", ":5000"])
def test_an_address_urllib_cannot_use_is_refused_at_start(address, capsys):
    def read(_prompt):
        raise AssertionError("asked for a prompt before refusing the address")

    with pytest.raises(SystemExit) as stop:
        load_tool("text_generation_cli").main([address], read=read)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1
    assert err.startswith(f"text_generation_cli.py: error: {address!r} is not the server's HOST:PORT")


def test_a_server_that_hangs_up_is_one_line(server, capsys):
    _Handler.answers = iter([(None, None)])
    typed = iter(["5 17", "1"])
    url = f"http://127.0.0.1:{server.server_port}/"  # a trailing slash is fine
    assert load_tool("text_generation_cli").main([url], read=lambda _prompt: next(typed)) == 2
    err = capsys.readouterr().err
    assert err == f"error: cannot reach {url}api (Remote end closed connection without response)\n"


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_prints_the_usage(flag, capsys):
    """--help was refused as an address ('takes one argument, the server's HOST:PORT (got --help)', exit 2)."""
    assert load_tool("text_generation_cli").main([flag]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: text_generation_cli.py HOST:PORT\n") and "PUT /api" in out


def test_ctrl_c_at_the_prompt_quits_without_a_traceback(capsys):
    def read(_prompt):
        raise KeyboardInterrupt

    assert load_tool("text_generation_cli").main(["localhost:5000"], read=read) == 130
    assert capsys.readouterr().err == "\n"
