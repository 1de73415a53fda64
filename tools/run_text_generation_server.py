"""Serve a megatron_lite GPT checkpoint over HTTP: Megatron's PUT /api, OpenAI-compatible
POST /v1/completions and /v1/chat/completions, GET /health. See docs/inference.md.

    python tools/run_text_generation_server.py --load checkpoints/gpt --port 5000
    torchrun --nproc-per-node 2 tools/run_text_generation_server.py --load checkpoints/gpt_tp2 --port 5000
    curl -X PUT localhost:5000/api -H 'Content-Type: application/json' \
        -d '{"prompts": ["Hello world"], "tokens_to_generate": 16, "top_k": 1}'

Concurrent OpenAI requests decode together (continuous batching, up to --inference-max-requests
sequences); --num-speculative-tokens N drafts with a model's multi-token prediction heads (TP, no PP).
Under torchrun, global rank 0 serves and the other ranks follow its requests. SIGTERM or Ctrl-C to
the serving process (its pid is printed) finishes the request in hand and stops every rank (exit 0).
Needs Flask (pip install megatron_lite[serve]).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lite.errors import ConfigError, OneLineParser, run_tool  # noqa: E402
from megatron_lite.inference.batch_runner import make_runner  # noqa: E402
from megatron_lite.inference.chat import read_chat_template  # noqa: E402
from megatron_lite.inference.cli import USER_ERRORS, add_inference_args, build_session, fail  # noqa: E402
from megatron_lite.inference.server import StopFlag, create_app, make_server, serve  # noqa: E402
from megatron_lite.inference.speculative import served_line  # noqa: E402

# the paged cache's and chunked prefill's flags: (flag, dest, default)
BATCHING_DEFAULTS = [("--inference-dynamic-batching-block-size", "inference_dynamic_batching_block_size", 16),
                     ("--inference-kv-cache-blocks", "inference_kv_cache_blocks", None),
                     ("--max-num-batched-tokens", "max_num_batched_tokens", 512),
                     ("--enable-prefix-caching", "enable_prefix_caching", True)]


def parse_args(argv=None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=5000, help="port to listen on (0: any free port, printed)")
    p.add_argument("--chat-template", default=None,
                   help="Jinja2 chat template file for /v1/chat/completions (default: the tokenizer's, else SFT's default)")
    p.add_argument("--model-name", default="megatron_lite", help="the model name the OpenAI responses report")
    p.add_argument("--inference-max-requests", type=int, default=8,
                   help="continuous batching: at most this many sequences decode together (a request holds one "
                        "per prompt, times n); 1 serves requests one at a time (docs/inference.md)")
    p.add_argument("--inference-dynamic-batching-block-size", type=int, default=None,
                   help="continuous batching: tokens per block of the paged key/value cache (default 16; "
                        "Megatron-LM's default is 256, sized for GPUs)")
    p.add_argument("--inference-kv-cache-blocks", type=int, default=None,
                   help="continuous batching: blocks in the paged key/value cache, per layer (default: enough for "
                        "every one of --inference-max-requests sequences to reach the model's context); a request "
                        "waits until its sequences' blocks are free, one that can never fit gets HTTP 400")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="continuous batching: at most this many tokens per step (default 512; vLLM's name): each decoding "
                        "sequence feeds one, prefills are chunked into the rest (chunked prefill); at least "
                        "--inference-max-requests")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="continuous batching: keep full blocks of the key/value cache (prompt and generated tokens) named "
                        "by their tokens, so a prompt starting with the same blocks reuses them instead of computing "
                        "them again "
                        "(default: on, as vLLM's; --no-enable-prefix-caching turns it off)")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="speculative decoding (vLLM's name): draft this many tokens per step with the model's "
                        "multi-token prediction heads (at most its --mtp-num-layers); a request it serves (no "
                        "penalties, logit_bias, stop strings or streamed logprobs) runs apart from the batch with "
                        "drafts (its prompts, and queued requests of equal parameters, as one batch), the others "
                        "as without the flag (docs/inference.md); no pipeline parallelism")
    add_inference_args(p)
    args = p.parse_args(argv)
    if not 0 <= args.port <= 65535:
        p.error(f"--port {args.port} must be in [0, 65535] (0: any free port)")
    if args.num_speculative_tokens is not None and args.num_speculative_tokens < 1:
        p.error(f"--num-speculative-tokens {args.num_speculative_tokens} must be at least 1 (or left out)")
    args.speculative_fall_back = True  # what speculation does not serve runs without it
    args.batching_flags = [flag for flag, dest, _ in BATCHING_DEFAULTS if getattr(args, dest) not in (None, False)]
    for _, dest, default in BATCHING_DEFAULTS:  # set only where given: refused when nothing batches
        if getattr(args, dest) is None:
            setattr(args, dest, default)
    return args


def check_batching_args(args) -> None:
    """ConfigError (one line) for a paged cache or a step budget the batch cannot run, or given
    where nothing batches (one request at a time: each prefilled whole, in its own static cache)."""
    off = ("--inference-max-requests 1" if args.inference_max_requests == 1
           else "--no-kv-cache" if getattr(args, "no_kv_cache", False) else None)
    if off is not None and getattr(args, "batching_flags", []):
        raise ConfigError(f"{args.batching_flags[0]} sets continuous batching's paged cache and chunked prefill, which "
                          f"{off} turns off (requests run one at a time, each prefilled whole); drop it, or "
                          f"{'raise --inference-max-requests' if args.inference_max_requests == 1 else 'drop --no-kv-cache'}")
    if args.inference_dynamic_batching_block_size < 1:
        raise ConfigError(f"--inference-dynamic-batching-block-size {args.inference_dynamic_batching_block_size} "
                          "must be at least 1")
    if args.inference_kv_cache_blocks is not None and args.inference_kv_cache_blocks < 1:
        raise ConfigError(f"--inference-kv-cache-blocks {args.inference_kv_cache_blocks} must be at least 1 "
                          "(or left out: every sequence can reach the model's context)")
    if args.inference_max_requests > 1 and args.max_num_batched_tokens < args.inference_max_requests:
        raise ConfigError(f"--max-num-batched-tokens {args.max_num_batched_tokens} must be at least "
                          f"--inference-max-requests {args.inference_max_requests} (each decoding sequence feeds "
                          "one token per step); raise it")


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.inference_max_requests < 1:
            raise ConfigError(f"--inference-max-requests {args.inference_max_requests} must be at least 1 "
                              "(1: one request at a time)")
        check_batching_args(args)
        session = build_session(args)
        chat_template = read_chat_template(args.chat_template)
        runner = make_runner(session.engine, args.inference_max_requests,
                             block_size=args.inference_dynamic_batching_block_size,
                             num_blocks=args.inference_kv_cache_blocks, max_batched_tokens=args.max_num_batched_tokens,
                             prefix_caching=args.enable_prefix_caching)
        if not session.is_rank0:
            runner.follow()
            return 0
        app = create_app(runner, session.tokenizer, chat_template=chat_template, model_name=args.model_name)
        server = make_server(app, args.host, args.port, threaded=runner.batched)
    except (*USER_ERRORS, OSError) as err:
        return fail(err)
    stop = StopFlag(signals=True)
    print(f"serving {args.load} on http://{args.host}:{server.server_port} (pid {os.getpid()}, "
          f"{session.state.world_size} rank(s))", flush=True)
    serve(server, runner, stop)
    if args.num_speculative_tokens:
        print(served_line(session.engine.served, args.num_speculative_tokens), flush=True)
    print("server stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
