"""The text-generation server: a Flask app over the engine (Megatron's ``PUT /api``, the
OpenAI-compatible ``/v1/completions``, ``/v1/chat/completions`` and ``GET /v1/models``, ``GET /health``).

Here requests are served one at a time, in the main thread (generation is one batch on every
rank): ``--inference-max-requests 1``, or ``--no-kv-cache``. Otherwise the server batches
concurrent requests (:mod:`.batch_runner`, which extends :class:`Runner`).
Under torchrun, global rank 0 serves HTTP and the other ranks follow: for each request rank 0
broadcasts the job (token ids and sampling parameters, already checked) and every rank runs the
engine on it together. While idle, rank 0 broadcasts a heartbeat every ``HEARTBEAT_S`` so the
followers' wait never reaches the process-group timeout, and on SIGTERM or SIGINT it finishes the
request in hand, stops serving and tells the followers to exit: every rank exits with code 0.

Errors: a bad request gets HTTP 400 (a ``model`` other than ``--model-name``: 404); any other error raised while serving a
request (e.g. :class:`~megatron_lite.inference.sampling.NonFiniteLogitsError`, which every rank
raises together) gets HTTP 500 (its traceback goes to rank 0's log), and the
server goes on serving; the followers survive the same errors and wait for the next job. A
request no route takes gets the same JSON (404 naming the routes, 405 naming the methods:
:mod:`.http_errors`), and so does a body over ``MAX_BODY_BYTES`` (413). On the ``/v1/`` routes every
error is OpenAI's ``{"error": {"message", "type", "param", "code"}}`` (``param``: the field the
message names), which OpenAI's client raises as ``BadRequestError``, ``NotFoundError``, ...; elsewhere
(``PUT /api``) ``{"message": ...}`` (:func:`.http_errors.error_body`).
"""

from __future__ import annotations

import contextlib
import io
import signal
import sys
import threading
import time

import torch.distributed as dist

from .api_beam import run_beams
from .api_megatron import api_response, parse_api
from .api_openai import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    UNSUPPORTED,
    check_model,
    openai_response,
    parse_chat,
    parse_completion,
)
from .api_stream import stream_events
from .fields import RequestError
from .http_errors import error_body, error_param, install_json_errors

HEARTBEAT_S = 60.0
CLIENT_TIMEOUT_S = 10.0
"""A connection whose client sends nothing (its request line, headers or body) or reads nothing (a
streamed answer) for this long is closed: a stalled client held the one-at-a-time server, and the
in-flight count that keeps SIGTERM waiting, forever."""
MAX_BODY_BYTES = 32 * 2**20
"""The largest request body read (Flask's MAX_CONTENT_LENGTH); a larger one gets HTTP 413 naming it.
32 MiB holds about 4 million token ids in JSON: 128 prompts (a request's most) of 32k tokens each."""
_GENERATE, _HEARTBEAT, _STOP = "generate", "heartbeat", "stop"


class Runner:
    """Runs a job on every rank: rank 0 calls :meth:`run`, the others :meth:`follow`."""

    batched = False  # one request at a time (continuous batching: :class:`~.batch_runner.BatchRunner`)

    def __init__(self, engine):
        self.engine = engine
        self.world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    def _send(self, message) -> None:
        if self.world > 1:
            dist.broadcast_object_list([message], src=0)

    def run(self, prompts, params):
        self._send((_GENERATE, prompts, params))
        return self.engine.generate(prompts, params)

    def stream(self, prompts, params):
        """:meth:`run` one decode step at a time (the engine's :meth:`stream`): the followers run the
        same job with ``generate``, so whoever iterates the steps must run them all (a speculative
        engine's steps can be cut short: :class:`Cancellable`)."""
        self._send((_GENERATE, prompts, params))
        if not getattr(self.engine, "cancellable", False):
            return self.engine.stream(prompts, params)
        flag = threading.Event()
        return Cancellable(self.engine.stream(prompts, params, cancelled=flag.is_set), flag)

    def heartbeat(self) -> None:
        self._send((_HEARTBEAT,))

    def stop(self) -> None:
        self._send((_STOP,))

    def follow(self) -> None:
        """On ranks other than 0: run every job rank 0 broadcasts until it says stop."""
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            if box[0][0] == _STOP:
                return
            if box[0][0] == _GENERATE:
                try:
                    self.engine.generate(*box[0][1:])
                except ValueError:
                    pass  # rank 0 raised the same error before any collective and answered 400
                except Exception as err:  # noqa: BLE001 - rank 0 answers it (500) and serves on: so do we
                    print(f"rank {dist.get_rank()}: request failed: {type(err).__name__}: {err}",
                          file=sys.stderr, flush=True)
            elif box[0][0] != _HEARTBEAT:
                self.on_message(box[0])

    def on_message(self, message) -> None:
        """A follower's other messages (continuous batching's steps, :mod:`.batch_runner`)."""
        raise RuntimeError(f"unknown server message {message[0]!r}")


def cancel_args(engine, flag: threading.Event) -> dict:
    """The engine's ``stream`` arguments that let ``flag`` (set: the streaming client left) end its
    request early: a :class:`~.speculative.SpeculativeEngine` stops after the verify step in hand."""
    return {"cancelled": flag.is_set} if getattr(engine, "cancellable", False) else {}


class Cancellable:
    """The engine's steps; :meth:`cancel` (the streaming client left, :func:`~.api_stream.drain`) sets
    ``flag``, which a speculative request reads at its next verify step; the steps still run to their end."""

    def __init__(self, steps, flag: threading.Event):
        self.steps, self.flag = steps, flag

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.steps)

    def cancel(self) -> None:
        self.flag.set()


def read_json(request):
    """The request's JSON body (whatever its Content-Type, as Megatron-LM's and vLLM's clients send
    it); RequestError where it is not JSON, or nests deeper than Python's parser recurses."""
    try:
        body = request.get_json(force=True, silent=True)
    except RecursionError:
        raise RequestError("the request body nests too deeply to be read as JSON") from None
    if body is None:
        raise RequestError("the request body must be JSON")
    return body


def create_app(runner: Runner, tokenizer, *, chat_template: str | None = None, model_name: str = "megatron_lite"):
    """The Flask app; ``runner.run(prompts, params)`` generates; ``chat_template``: ``--chat-template``'s text."""
    try:
        from flask import Flask, Response, jsonify, request
    except ImportError:
        raise ImportError("the server needs Flask: pip install megatron_lite[serve]") from None

    app = Flask("megatron_lite")
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY_BYTES  # unbounded, a client could fill the memory

    install_json_errors(app)  # 404, 405, ...: JSON too

    @app.errorhandler(Exception)
    def server_error(err):
        """Any other error raised while serving a request: HTTP 500 with a JSON message, not Flask's
        HTML page."""
        app.logger.exception("request failed")
        return jsonify(error_body(request.path, f"{type(err).__name__}: {err}", 500)), 500

    def refuse(err: ValueError, fields):
        """A bad request's answer: its status (UnknownModel: 404), with OpenAI's ``param`` naming the
        one of the route's ``fields`` the message names."""
        message, status = str(err), getattr(err, "status", 400)
        param = getattr(err, "param", None) or error_param(message, fields)
        return jsonify(error_body(request.path, message, status, param)), status

    def answer(parse, respond, fields=frozenset()):
        try:
            body = read_json(request)
            job = parse(body)
            if getattr(job, "stream", False):
                steps = runner.stream(job.prompts, job.params)
            elif getattr(job, "beam", False):  # beam search runs alone between steps of the batch
                results = run_beams(runner.run, job)
            else:
                results = runner.run(job.prompts, job.params)
        except (RequestError, ValueError) as err:
            return refuse(err, fields)
        if getattr(job, "stream", False):
            usage = lambda res: openai_response(job, res, tokenizer, model_name)["usage"]  # noqa: E731
            return Response(stream_events(job, steps, tokenizer, model_name, usage), mimetype="text/event-stream",
                            headers={"Cache-Control": "no-cache"})
        return jsonify(respond(job, results))

    @app.route("/api", methods=["PUT"])
    def megatron_api():
        return answer(lambda body: parse_api(body, tokenizer), lambda job, res: api_response(job, res, tokenizer))

    def openai(parse, fields):
        def checked(body):
            check_model(body, model_name)
            return parse(body)
        return answer(checked, lambda job, res: openai_response(job, res, tokenizer, model_name), fields | set(UNSUPPORTED))

    @app.route("/v1/completions", methods=["POST"])
    def completions():
        return openai(lambda body: parse_completion(body, tokenizer, runner.engine.max_sequence_length),
                      COMPLETION_FIELDS)

    @app.route("/v1/chat/completions", methods=["POST"])
    def chat_completions():
        return openai(lambda body: parse_chat(body, tokenizer, chat_template, runner.engine.max_sequence_length),
                      CHAT_FIELDS)

    @app.route("/health", methods=["GET"])
    def health():
        return jsonify(status="ok")

    created = int(time.time())

    @app.route("/v1/models", methods=["GET"])
    def models():
        """OpenAI's model list (what clients read to find the model's name), vLLM's one entry."""
        return jsonify(object="list", data=[{"id": model_name, "object": "model", "created": created,
                                             "owned_by": "megatron_lite",
                                             "max_model_len": runner.engine.max_sequence_length}])

    return app


class InFlight:
    """WSGI middleware counting the requests a threaded server holds: from the moment a handler
    thread calls the app until its response is written (the response iterable closed). The
    batching server's loop does not stop while one is in flight (:meth:`BatchRunner.serve
    <.batch_runner.BatchRunner.serve>`): a request accepted before SIGTERM but not yet handed to the
    engine, or one whose answer is still being written, is finished."""

    def __init__(self, app):
        self.app, self.count = app, 0
        self._lock = threading.Lock()

    def _done(self) -> None:
        with self._lock:
            self.count -= 1

    def __call__(self, environ, start_response):
        with self._lock:
            self.count += 1
        try:
            return _Counted(self.app(environ, start_response), self._done)
        except BaseException:
            self._done()
            raise


class _Counted:
    """A response iterable whose ``close`` always calls ``done``, even when the app's own close raises
    (werkzeug's ClosingIterator skips the callbacks after one that raises: a request whose teardown
    failed, e.g. on a client's timed-out socket, stayed counted and the server never stopped)."""

    def __init__(self, iterable, done):
        self.iterable, self.done = iterable, done

    def __iter__(self):
        return iter(self.iterable)

    def close(self) -> None:
        try:
            close = getattr(self.iterable, "close", None)
            if close is not None:
                close()
        finally:
            self.done()


def make_server(app, host: str, port: int, threaded: bool = False):
    """A single-threaded HTTP server for ``app`` (port 0: a free one, see ``server.server_port``); OSError
    (one line) where it cannot listen (the port in use);
    ``threaded``: one thread per request (continuous batching: :mod:`.batch_runner`), counted in
    ``server.in_flight`` (:class:`InFlight`)."""
    from werkzeug.serving import WSGIRequestHandler
    from werkzeug.serving import make_server as werkzeug_server

    class Handler(WSGIRequestHandler):
        timeout = CLIENT_TIMEOUT_S  # socketserver sets it on every accepted connection

    in_flight = InFlight(app) if threaded else None
    said = io.StringIO()  # werkzeug prints why it cannot listen (two lines) and exits 1: one line, raised
    try:
        with contextlib.redirect_stderr(said):
            server = werkzeug_server(host, port, in_flight or app, threaded=threaded, request_handler=Handler)
    except SystemExit:
        reason = said.getvalue().strip().splitlines()[0] if said.getvalue().strip() else "cannot listen"
        raise OSError(f"--host {host} --port {port}: {reason}; pick another --port (0: any free port) or --host") from None
    server.timeout = 0.5  # handle_request returns this often when idle
    server.in_flight = in_flight
    return server


class StopFlag:
    """Set by SIGTERM / SIGINT (or by a caller) to end :func:`serve` after the request in hand."""

    def __init__(self, signals: bool = False):
        self.set = False
        if signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: self.request())

    def request(self) -> None:
        self.set = True


def serve(server, runner: Runner, stop: StopFlag) -> None:
    """Serve requests until ``stop`` is set; then tell the followers to exit."""
    if getattr(runner, "batched", False):
        return runner.serve(server, stop)
    last = time.monotonic()
    try:
        while not stop.set:
            server.handle_request()
            if time.monotonic() - last > HEARTBEAT_S:
                runner.heartbeat()
                last = time.monotonic()
    finally:
        runner.stop()
        server.server_close()
