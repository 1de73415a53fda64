"""Mixture-of-experts benchmarks on CPU.

1. ``grouped``: the local experts as one grouped GEMM (padded batched matmul on CPU) vs the
   sequential loop, 8 local experts, SwiGLU, forward + backward; both compute the same numbers
   (checked), at the given shape and at a tiny-model shape (128 tokens, hidden 64, ffn 128).
   Target: grouped >= 1.5x faster.
2. ``alltoall``: the all-to-all dispatcher at EP=2 (2 processes x 1 thread, gloo): bytes of token
   activations sent per step counted by the dispatcher vs the formula from the routing map
   ``2 (there and back) x hidden x 4 bytes x routed slots whose expert is on the other rank``,
   and the dispatch + identity experts + combine time at EP=2 vs EP=1 (one process, one thread).
3. ``gpt``: tokens/s of an MoE GPT (8 experts of FFN f, top-2, grouped GEMM, alltoall) vs a dense
   GPT with FFN 2f (the same active parameters per token), forward + backward, one process.
4. ``fusion``: the experts' bias + activation through the fused functions (``--bias-gelu-fusion`` /
   ``--bias-swiglu-fusion``, Megatron's CLI defaults) vs unfused with the same math (tanh GeLU):
   8 grouped and 8 sequential local experts, GeLU with biases and SwiGLU without, fp32 and bf16,
   forward + backward, both computing the same numbers (max difference printed); then a whole MoE
   GPT step (4 layers, GeLU with biases) fused vs unfused.

Rounds alternate the compared variants in one process; medians are reported.

    python benchmarks/bench_moe.py [--part grouped|alltoall|gpt|fusion|all] [--rounds 5]
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from benchmarks.common import OneLineParser, describe_machine, positive_int  # noqa: E402
from megatron_lite.models.transformer_config import TransformerConfig  # noqa: E402


def _config(num_experts, hidden, ffn, topk=2, ep=1, **overrides):
    kw = dict(num_layers=2, hidden_size=hidden, num_attention_heads=1, num_experts=num_experts,
              ffn_hidden_size=4 * hidden, moe_ffn_hidden_size=ffn, swiglu=True, add_bias_linear=False,
              moe_router_topk=topk, moe_token_dispatcher_type="alltoall", expert_model_parallel_size=ep)
    return TransformerConfig(**{**kw, **overrides})


def _alternate(runs: dict, rounds: int, reps: int) -> dict:
    """Median seconds per call of each no-argument function, the order reversed every other round."""
    times = {name: [] for name in runs}
    for fn in runs.values():
        fn()  # warm-up
    for r in range(rounds):
        for name in (list(runs) if r % 2 == 0 else list(reversed(runs))):
            times[name].append(_time(runs[name], reps))
    return {name: statistics.median(t) for name, t in times.items()}


def _time(fn, reps):
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def bench_grouped(rounds: int, tokens: int, hidden: int, ffn: int) -> None:
    from megatron_lite.moe.experts import GroupedExperts, SequentialExperts
    from megatron_lite.parallel.state import ParallelState

    torch.set_num_threads(1)
    config, state = _config(8, hidden, ffn), ParallelState()
    seq, grp = SequentialExperts(config, state, 1), GroupedExperts(config, state, 1)
    gen = torch.Generator().manual_seed(0)
    counts = torch.multinomial(torch.ones(8), tokens * 2, replacement=True, generator=gen).bincount(minlength=8)
    tpe = counts.tolist()
    x = torch.randn(sum(tpe), hidden, generator=gen)
    probs = torch.rand(sum(tpe), generator=gen)

    def step(module):
        def run():
            xi = x.clone().requires_grad_()
            module(xi, probs, tpe).sum().backward()
        return run

    diff = (seq(x, probs, tpe) - grp(x, probs, tpe)).abs().max().item()
    times = {"loop": [], "grouped": []}
    for module in (seq, grp):
        step(module)()  # warm-up
    for r in range(rounds):
        order = (("loop", seq), ("grouped", grp)) if r % 2 == 0 else (("grouped", grp), ("loop", seq))
        for name, module in order:
            times[name].append(_time(step(module), 3))
    loop, grouped = statistics.median(times["loop"]), statistics.median(times["grouped"])
    print(f"grouped GEMM vs loop: 8 experts, {sum(tpe)} rows ({tpe}), hidden {hidden}, ffn {ffn}, SwiGLU, fwd+bwd, "
          f"1 thread, max |diff| {diff:.2e}")
    print(f"  loop {loop * 1e3:.2f} ms, grouped {grouped * 1e3:.2f} ms, speed-up {loop / grouped:.2f}x (target >= 1.5)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _a2a_worker(rank, world, port, tokens, hidden, rounds, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      MEGATRON_LITE_DEVICE="cpu")
    torch.set_num_threads(1)
    import torch.distributed as dist

    from megatron_lite.moe.dispatcher import AllToAllDispatcher
    from megatron_lite.moe.routing import topk_routing
    from megatron_lite.parallel.state import ParallelState

    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    state = ParallelState(ep=world)
    dispatcher = AllToAllDispatcher(_config(8, hidden, hidden, ep=world), state)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, hidden, generator=gen)
    probs, rmap = topk_routing(torch.randn(tokens, 8, generator=gen), 2)
    local = 8 // world
    remote = int(rmap.sum()) - int(rmap[:, rank * local:(rank + 1) * local].sum())

    def identity(rows, weights, tokens_per_expert):
        return rows * weights.unsqueeze(-1)

    def step():
        xi = x.clone().requires_grad_()
        dispatcher.run(xi, probs, rmap, identity).sum().backward()

    step()
    dispatcher.bytes_sent = 0
    step()
    counted, formula = dispatcher.bytes_sent, 2 * hidden * 4 * remote
    times = []
    for _ in range(rounds):
        if world > 1:
            dist.barrier()
        times.append(_time(step, 3))
    results.put((rank, counted, formula, statistics.median(times)))
    if world > 1:
        dist.destroy_process_group()


def bench_alltoall(rounds: int, tokens: int, hidden: int) -> None:
    ctx = mp.get_context("spawn")
    summary = {}
    for world in (1, 2):
        results = ctx.Queue()
        port = _free_port()
        procs = [ctx.Process(target=_a2a_worker, args=(r, world, port, tokens, hidden, rounds, results))
                 for r in range(world)]
        for p in procs:
            p.start()
        rows = sorted(results.get() for _ in procs)
        for p in procs:
            p.join()
        summary[world] = rows
    print(f"all-to-all dispatcher: {tokens} tokens per rank, hidden {hidden}, 8 experts, top-2, fwd+bwd, 1 thread/rank")
    for rank, counted, formula, _ in summary[2]:
        print(f"  EP=2 rank {rank}: bytes sent per step counted {counted}, formula {formula}, "
              f"{'equal' if counted == formula else 'DIFFERENT'}")
    t1, t2 = summary[1][0][3], max(r[3] for r in summary[2])
    print(f"  time per step: EP=1 {t1 * 1e3:.2f} ms, EP=2 {t2 * 1e3:.2f} ms (EP=2 / EP=1 = {t2 / t1:.2f})")


def bench_gpt(rounds: int, hidden: int, ffn: int) -> None:
    from megatron_lite.models.gpt import GPTModel
    from megatron_lite.parallel.state import ParallelState

    torch.set_num_threads(1)
    batch, seq = 4, 128
    shape = dict(num_layers=4, hidden_size=hidden, num_attention_heads=4, seq_length=seq, vocab_size=4096,
                 swiglu=True, add_bias_linear=False, attention_dropout=0.0, hidden_dropout=0.0,
                 position_embedding_type="rope", normalization="RMSNorm")
    models = {
        "dense": GPTModel(TransformerConfig(ffn_hidden_size=2 * ffn, **shape), ParallelState()),
        "moe": GPTModel(TransformerConfig(num_experts=8, ffn_hidden_size=2 * ffn, moe_ffn_hidden_size=ffn, moe_router_topk=2,
                                          moe_grouped_gemm=True, moe_token_dispatcher_type="alltoall", **shape),
                        ParallelState()),
    }
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 4096, (batch, seq), generator=gen)
    labels = torch.randint(0, 4096, (batch, seq), generator=gen)

    def step(model):
        return lambda: model(tokens, labels=labels).mean().backward()

    times = {name: [] for name in models}
    for model in models.values():
        step(model)()
    for r in range(rounds):
        for name in (list(models) if r % 2 == 0 else list(reversed(models))):
            times[name].append(_time(step(models[name]), 2))
    params = {name: sum(p.numel() for p in m.parameters()) for name, m in models.items()}
    tps = {name: batch * seq / statistics.median(t) for name, t in times.items()}
    print(f"MoE GPT vs dense GPT of the same active parameters: 4 layers, hidden {hidden}, seq {seq}, batch {batch}, "
          f"1 thread; MoE 8 x ffn {ffn} top-2 ({params['moe']:,} params), dense ffn {2 * ffn} ({params['dense']:,})")
    print(f"  tokens/s: dense {tps['dense']:.0f}, MoE {tps['moe']:.0f}, MoE / dense = {tps['moe'] / tps['dense']:.2f}")


def bench_fusion(rounds: int, tokens: int, hidden: int, ffn: int) -> None:
    from megatron_lite.models.gpt import GPTModel
    from megatron_lite.moe.experts import GroupedExperts, SequentialExperts
    from megatron_lite.parallel.state import ParallelState

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    tpe = torch.multinomial(torch.ones(8), tokens * 2, replacement=True, generator=gen).bincount(minlength=8).tolist()
    print(f"experts' bias + activation fused vs unfused (tanh GeLU both): 8 local experts, {sum(tpe)} rows, "
          f"hidden {hidden}, ffn {ffn}, fwd+bwd, 1 thread")
    for cls in (GroupedExperts, SequentialExperts):
        for act, extra in (("GeLU+bias", dict(swiglu=False, add_bias_linear=True)), ("SwiGLU", {})):
            for dtype in (torch.float32, torch.bfloat16):
                fused = cls(_config(8, hidden, ffn, params_dtype=dtype, bias_activation_fusion=True, **extra),
                            ParallelState(), 1)
                unfused = cls(_config(8, hidden, ffn, params_dtype=dtype, openai_gelu=not extra.get("swiglu", True),
                                      **extra), ParallelState(), 1)
                with torch.no_grad():
                    for p in fused.parameters():
                        p.add_(torch.randn(p.shape, generator=gen).to(dtype) * 0.1)  # non-zero biases
                unfused.load_state_dict(fused.state_dict())
                x = torch.randn(sum(tpe), hidden, generator=gen).to(dtype)
                probs = torch.rand(sum(tpe), generator=gen)
                diff = (fused(x, probs, tpe) - unfused(x, probs, tpe)).abs().max().item()

                def step(module, x=x, probs=probs):
                    return lambda: module(x.clone().requires_grad_(), probs, tpe).sum().backward()

                t = _alternate({"unfused": step(unfused), "fused": step(fused)}, rounds, 3)
                print(f"  {cls.__name__:17s} {act:9s} {str(dtype)[6:]:8s} unfused {t['unfused'] * 1e3:7.2f} ms, "
                      f"fused {t['fused'] * 1e3:7.2f} ms, unfused / fused {t['unfused'] / t['fused']:.2f}x, "
                      f"max |diff| {diff:.1e}")
    batch, seq = 4, 128
    shape = dict(num_layers=4, hidden_size=hidden, num_attention_heads=4, seq_length=seq, vocab_size=4096,
                 attention_dropout=0.0, hidden_dropout=0.0, num_experts=8, ffn_hidden_size=2 * ffn,
                 moe_ffn_hidden_size=ffn, moe_router_topk=2, moe_grouped_gemm=True,
                 moe_token_dispatcher_type="alltoall")
    models = {name: GPTModel(TransformerConfig(**shape, **extra), ParallelState()) for name, extra in
              (("unfused", dict(openai_gelu=True)), ("fused", dict(bias_activation_fusion=True)))}
    models["unfused"].load_state_dict(models["fused"].state_dict())
    tokens, labels = (torch.randint(0, 4096, (batch, seq), generator=gen) for _ in range(2))
    t = _alternate({name: (lambda m=m: m(tokens, labels=labels).mean().backward()) for name, m in models.items()},
                   rounds, 2)
    print(f"  MoE GPT step (4 layers, hidden {hidden}, seq {seq}, batch {batch}, 8 x ffn {ffn} top-2, GeLU+bias, "
          f"fp32): unfused {t['unfused'] * 1e3:.1f} ms, fused {t['fused'] * 1e3:.1f} ms, unfused / fused "
          f"{t['unfused'] / t['fused']:.2f}x")


def main() -> None:
    parser = OneLineParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=["grouped", "alltoall", "gpt", "fusion", "all"], default="all")
    parser.add_argument("--rounds", type=positive_int, default=5)
    parser.add_argument("--tokens", type=positive_int, default=1024)
    parser.add_argument("--hidden", type=positive_int, default=256)
    parser.add_argument("--ffn", type=positive_int, default=512)
    args = parser.parse_args()
    print(describe_machine(threads=1))
    if args.part in ("grouped", "all"):
        bench_grouped(args.rounds, args.tokens, args.hidden, args.ffn)
        if (args.tokens, args.hidden, args.ffn) != (128, 64, 128):  # and a tiny-model shape
            bench_grouped(args.rounds, 128, 64, 128)
    if args.part in ("alltoall", "all"):
        bench_alltoall(args.rounds, args.tokens, args.hidden)
    if args.part in ("gpt", "all"):
        bench_gpt(args.rounds, args.hidden, args.ffn)
    if args.part in ("fusion", "all"):
        bench_fusion(args.rounds, args.tokens, args.hidden, args.ffn)


if __name__ == "__main__":
    main()
