"""Continuous batching vs one request at a time, and a paged key/value cache vs a slab per row, same
model, same requests, one process.

A GPT with random weights (default 4 layers, hidden 256, 8 heads, vocab 8192, RoPE, fp32, CPU) serves
``--requests`` greedy requests whose prompt lengths and answer lengths differ (prompts 16-64 tokens,
answers 16-192 tokens, fixed by ``--seed``), all waiting at the start:

* one at a time: ``InferenceEngine.generate`` on each in turn (what the server does with
  ``--inference-max-requests 1``);
* slab: the continuous-batching :class:`~megatron_lite.inference.scheduler.Scheduler` with
  ``--max-requests`` rows (the server's default 8), each row one block of the whole context (256
  tokens: the memory of the slab cache that paging replaced): requests join as rows free up and leave
  when done;
* paged: the same memory (``--max-requests`` x 256 tokens) as blocks of ``--block-size`` tokens
  (the server's default 16) and twice the rows: a request joins when its sequences' blocks are free,
  so more short requests decode together; prefills are chunked within ``--max-num-batched-tokens``.

Printed per mode: wall time, generated tokens per second, steps (one at a time: forward passes, a
prefill and one per later token; batched: scheduler steps, each one decode pass over the batch plus a
prefill pass when requests join), the most sequences decoding at once, and the mean and worst
time a request waits for its answer; then the ratios slab / one at a time and paged / slab. The
answers of every mode are checked to be the same tokens. Rounds alternate the modes; medians are
reported.

    python benchmarks/bench_batching.py [--requests 16] [--max-requests 8] [--block-size 16] [--rounds 3]
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.common import (  # noqa: E402
    OneLineParser,
    add_inference_model_args,
    describe_machine,
    positive_int,
    times_less,
)


def parse_args(argv=None):
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=positive_int, default=16)
    p.add_argument("--max-requests", type=positive_int, default=8, help="rows of the batch (the server's default 8)")
    p.add_argument("--block-size", type=positive_int, default=16, help="tokens per block of the paged mode")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=512, help="tokens per step of the paged mode")
    add_inference_model_args(p, rounds=3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


LENGTH = 64 + 192  # the model's context: the longest prompt and answer


def build_engine(args, length: int = LENGTH):
    from megatron_lite.config import ModelConfig
    from megatron_lite.inference.engine import InferenceEngine
    from megatron_lite.models import GPTModel, TransformerConfig
    from megatron_lite.parallel.state import ParallelState
    from megatron_lite.parallel.tensor import padded_vocab_size

    cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                      seq_length=length, max_position_embeddings=length, vocab_size=args.vocab,
                      position_embedding_type="rope", attention_dropout=0.0, hidden_dropout=0.0)
    cfg.padded_vocab_size = padded_vocab_size(args.vocab, 128, 1)
    state = ParallelState(world_size=1, rank=0)
    model = GPTModel(TransformerConfig.from_model(cfg, init_method_std=0.2), state)
    return InferenceEngine(model, state, vocab_size=args.vocab, max_sequence_length=length)


def workload(args):
    from megatron_lite.inference.sampling import SamplingParams

    rng = random.Random(args.seed)
    out = []
    for _ in range(args.requests):
        prompt = [rng.randrange(args.vocab) for _ in range(rng.randint(16, 64))]
        out.append(([prompt], SamplingParams(tokens_to_generate=rng.randint(16, 192), top_k=1, stop_on_eod=False)))
    return out


def one_at_a_time(engine, requests):
    start, done, answers = time.perf_counter(), [], []
    for prompts, params in requests:
        answers.append([r.tokens for r in engine.generate(prompts, params)])
        done.append(time.perf_counter() - start)
    passes = sum(p.tokens_to_generate for _, p in requests)  # a prefill, then one pass per later token
    return time.perf_counter() - start, done, answers, passes, 1


def batched(engine, requests, rows: int, **cache):
    from megatron_lite.inference.scheduler import Scheduler

    scheduler = Scheduler(engine, rows, **cache)
    for prompts, params in requests:
        scheduler.add(prompts, params)
    start, done, answers, passes, most = time.perf_counter(), {}, {}, 0, 0
    while scheduler.busy:
        for event in scheduler.run_step():
            if event.error is not None:
                raise SystemExit(f"request {event.rid} failed: {event.error}")
            if event.results is not None:
                answers[event.rid] = [r.tokens for r in event.results]
                done[event.rid] = time.perf_counter() - start
        most = max(most, sum(len(r.rows) for r in scheduler.active))
        passes += 1
    order = sorted(answers)
    return time.perf_counter() - start, [done[i] for i in order], [answers[i] for i in order], passes, most


def modes(args):
    """name -> function(engine, requests) of each mode; the slab and the paged cache hold the same memory."""
    slab = dict(block_size=LENGTH, num_blocks=args.max_requests)
    paged = dict(block_size=args.block_size, num_blocks=args.max_requests * LENGTH // args.block_size,
                 max_batched_tokens=args.max_num_batched_tokens)
    return {"one at a time": one_at_a_time,
            "slab": lambda engine, requests: batched(engine, requests, args.max_requests, **slab),
            "paged": lambda engine, requests: batched(engine, requests, 2 * args.max_requests, **paged)}


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    engine, requests = build_engine(args), workload(args)
    new_tokens = sum(p.tokens_to_generate for _, p in requests)
    print(describe_machine(args.threads))
    print(f"{args.requests} greedy requests, {new_tokens} new tokens in all; slab: {args.max_requests} rows x "
          f"{LENGTH} tokens; paged: {2 * args.max_requests} rows, {args.max_requests * LENGTH // args.block_size} "
          f"blocks of {args.block_size} tokens (the same memory), {args.max_num_batched_tokens} tokens per step")
    runs = {name: [] for name in modes(args)}
    with torch.no_grad():
        for r in range(args.rounds):
            for name, mode in modes(args).items():
                runs[name].append(mode(engine, requests))
                if runs[name][-1][2] != runs["one at a time"][-1][2]:
                    raise SystemExit(f"the {name} answers differ from the one-at-a-time answers")
            print(f"round {r + 1}: " + ", ".join(f"{name} {runs[name][-1][0]:.2f} s" for name in runs), flush=True)
    print("| mode | wall s (median) | new tokens/s | steps | most sequences at once | mean wait s | worst wait s |")
    print("|---|---|---|---|---|---|---|")
    summary = {}
    for mode, results in runs.items():
        wall = statistics.median(r[0] for r in results)
        mean_wait = statistics.median(statistics.mean(r[1]) for r in results)
        worst = statistics.median(max(r[1]) for r in results)
        summary[mode] = (wall, mean_wait, worst)
        print(f"| {mode} | {wall:.2f} | {new_tokens / wall:.0f} | {results[0][3]} | {results[0][4]} | {mean_wait:.2f} "
              f"| {worst:.2f} |")
    for new, old in (("slab", "one at a time"), ("paged", "slab")):
        (wall_a, wait_a, worst_a), (wall_b, wait_b, worst_b) = summary[old], summary[new]
        print(f"{new} vs {old}: throughput {wall_a / wall_b:.2f}x, mean wait "
              f"{times_less(wait_a, wait_b, 'shorter', 'longer')}, worst wait "
              f"{times_less(worst_a, worst_b, 'shorter', 'longer')}; same tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
