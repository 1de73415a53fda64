"""Prefix caching on vs off in continuous batching: requests sharing a long system prompt, and a
multi-turn chat whose every turn sends the whole conversation again, one process.

A GPT with random weights (default 4 layers, hidden 256, 8 heads, vocab 8192, RoPE, fp32, CPU;
the model of benchmarks/bench_batching.py) behind the continuous-batching
:class:`~megatron_lite.inference.scheduler.Scheduler`, greedy answers, blocks of ``--block-size``:

* shared system prompt: ``--requests`` requests, each a ``--system``-token system prompt and its own
  ``--question`` tokens, answers of ``--answer`` tokens; the first is sent alone and the others
  after its first step (its prefill has named the system prompt's blocks), ``--max-requests`` rows;
* chat: ``--turns`` turns of one conversation, each ``--message`` new tokens after the last turn's
  prompt and answer (``--answer`` tokens); a turn is sent when the last one has answered, so with
  prefix caching it reuses the blocks of the whole conversation so far, the answers' included.

Each workload runs with prefix caching off and on in alternating rounds; printed per run: prompt
tokens, prefill tokens computed (prompt tokens less those taken from the cache: exact), wall time
(median of the rounds) and the ratios off / on; and whether the answers are the same tokens.

    python benchmarks/bench_prefix.py [--requests 8] [--system 384] [--turns 6] [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.bench_batching import build_engine  # noqa: E402
from benchmarks.common import (  # noqa: E402
    OneLineParser,
    add_inference_model_args,
    describe_machine,
    positive_int,
    times_less,
)


def parse_args(argv=None):
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=positive_int, default=8, help="requests sharing the system prompt")
    p.add_argument("--system", type=positive_int, default=384, help="tokens of the shared system prompt")
    p.add_argument("--question", type=positive_int, default=24, help="tokens of each request's own question")
    p.add_argument("--turns", type=positive_int, default=6, help="turns of the chat")
    p.add_argument("--message", type=positive_int, default=32, help="new tokens of each chat turn")
    p.add_argument("--answer", type=positive_int, default=32, help="tokens of each answer")
    p.add_argument("--max-requests", type=positive_int, default=4, help="rows of the batch")
    p.add_argument("--block-size", type=positive_int, default=16)
    add_inference_model_args(p, rounds=3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def context(args) -> int:
    """The model's context: the longer of a system-prompt request and the chat's last turn."""
    return max(args.system + args.question, args.turns * (args.message + args.answer)) + args.answer


def answer_all(scheduler, first, rest):
    """Run ``first``, then ``rest`` after its first step, to the end: answers in order."""
    answers = {}
    scheduler.add(*first)
    for step in range(10**6):
        if step == 1:
            for request in rest:
                scheduler.add(*request)
        for event in scheduler.run_step():
            if event.error is not None:
                raise SystemExit(f"request {event.rid} failed: {event.error}")
            if event.results is not None:
                answers[event.rid] = [r.tokens for r in event.results]
        if step >= 1 and not scheduler.busy:
            return [answers[i] for i in sorted(answers)]


def shared_system(scheduler, args, rng, params):
    system = [rng.randrange(args.vocab) for _ in range(args.system)]
    requests = [([system + [rng.randrange(args.vocab) for _ in range(args.question)]], params)
                for _ in range(args.requests)]
    return answer_all(scheduler, requests[0], requests[1:]), sum(len(p[0]) for p, _ in requests)


def chat(scheduler, args, rng, params):
    history, answers, prompt_tokens = [], [], 0
    for _ in range(args.turns):
        prompt = history + [rng.randrange(args.vocab) for _ in range(args.message)]
        prompt_tokens += len(prompt)
        answers += answer_all(scheduler, ([prompt], params), [])
        history = answers[-1][0]
    return answers, prompt_tokens


def run(engine, workload, args, caching: bool):
    from megatron_lite.inference.sampling import SamplingParams
    from megatron_lite.inference.scheduler import Scheduler

    scheduler = Scheduler(engine, args.max_requests, block_size=args.block_size, prefix_caching=caching)
    params = SamplingParams(tokens_to_generate=args.answer, top_k=1, stop_on_eod=False, prompt_log_probs=False)
    start = time.perf_counter()
    answers, prompt_tokens = workload(scheduler, args, random.Random(args.seed), params)
    return time.perf_counter() - start, answers, prompt_tokens, prompt_tokens - scheduler.cache.reused_tokens


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    engine = build_engine(args, context(args))
    print(describe_machine(args.threads))
    print(f"model: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, vocab {args.vocab}, fp32; "
          f"blocks of {args.block_size} tokens, {args.max_requests} rows; greedy answers of {args.answer} tokens")
    print(f"shared system prompt: {args.requests} requests of {args.system} + {args.question} tokens; "
          f"chat: {args.turns} turns of {args.message} new tokens")
    workloads = {"shared system prompt": shared_system, "chat": chat}
    runs = {(name, caching): [] for name in workloads for caching in (False, True)}
    with torch.no_grad():
        for r in range(args.rounds):
            for (name, caching), results in runs.items():
                results.append(run(engine, workloads[name], args, caching))
            print(f"round {r + 1}: " + ", ".join(f"{name} {'on' if c else 'off'} {res[-1][0]:.2f} s"
                                                 for (name, c), res in runs.items()), flush=True)
    print("| workload | prefix caching | prompt tokens | prefill tokens computed | wall s (median) |")
    print("|---|---|---|---|---|")
    for (name, caching), results in runs.items():
        wall = statistics.median(x[0] for x in results)
        print(f"| {name} | {'on' if caching else 'off'} | {results[0][2]} | {results[0][3]} | {wall:.2f} |")
    for name in workloads:
        off, on = runs[(name, False)], runs[(name, True)]
        wall_off, wall_on = (statistics.median(x[0] for x in res) for res in (off, on))
        same = all(a[1] == b[1] for a, b in zip(off, on))
        print(f"{name}: prefill tokens {times_less(off[0][3], on[0][3], 'fewer', 'more')}, wall time "
              f"{times_less(wall_off, wall_on, 'shorter', 'longer')}; {'same' if same else 'DIFFERENT'} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
