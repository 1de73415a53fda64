"""Parallel efficiency on CPU: TP=2 and DP=2 (2 processes x 1 thread) vs 1 process x 2 threads.

Every configuration trains the same GPT (default: the HF-comparison shape, 6 layers, hidden 768,
12 heads, seq 512, vocab 32768) on the same global batch with the project's stack: GPTModel,
DistributedDataParallel (contiguous fp32 grad buffer, overlapped bucket all-reduce),
finalize_model_grads, then ``torch.optim.AdamW`` on the ``main_grad``s. Processes are spawned with
torch.multiprocessing and talk over gloo. Dropout is 0 so the first-step loss of every
configuration must agree (a printed sanity check that the parallel runs compute the same thing).

    efficiency = t(1 process, 2 threads) / t(2 processes, 1 thread each)      (target >= 0.85)

and, as a check less sensitive to other load on a shared machine, the strong scaling from one core
t(1 process, 1 thread) / (2 x t(2 processes, 1 thread each)).

Each configuration runs in fresh processes: warm-up steps, then timed steps (rank 0's wall time
between barriers). With ``--rounds 2`` the order is base, base1, TP, DP, DP, TP, base1, base so slow drift of a
shared machine hits all alike; medians are reported.

    python benchmarks/bench_parallel_efficiency.py [--steps 3] [--rounds 1] [--small]
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

SHAPES = {
    "full": dict(num_layers=6, hidden_size=768, num_attention_heads=12, seq_length=512, vocab_size=32768),
    "small": dict(num_layers=2, hidden_size=256, num_attention_heads=8, seq_length=256, vocab_size=8192),
}
MODES = {  # name: (processes, threads per process, tensor-parallel size)
    "base": (1, 2, 1),
    "base1": (1, 1, 1),
    "tp2": (2, 1, 2),
    "dp2": (2, 1, 1),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, threads, tp, shape, global_batch, warmup, steps, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), MEGATRON_LITE_DEVICE="cpu")
    torch.set_num_threads(threads)
    import torch.distributed as dist

    from megatron_lite.device import init_distributed
    from megatron_lite.models import GPTModel, TransformerConfig
    from megatron_lite.parallel.data_parallel import DistributedDataParallel, finalize_model_grads
    from megatron_lite.parallel.random import model_parallel_seed
    from megatron_lite.parallel.state import ParallelState

    init_distributed()
    state = ParallelState(tp=tp)
    cfg = TransformerConfig(**shape, attention_dropout=0.0, hidden_dropout=0.0, tensor_model_parallel_size=tp)
    model_parallel_seed(1234, state)
    model = DistributedDataParallel(GPTModel(cfg, state), state, overlap_grad_reduce=True)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (global_batch, cfg.seq_length), generator=gen)
    labels = torch.roll(tokens, -1, dims=1)
    per_rank = global_batch // state.dp_size
    rows = slice(state.dp_rank * per_rank, (state.dp_rank + 1) * per_rank)
    tokens, labels = tokens[rows], labels[rows]

    phases = {"forward": 0.0, "backward": 0.0, "grad sync": 0.0, "optimizer": 0.0}

    def step():
        t0 = time.perf_counter()
        model.zero_grad_buffer()
        loss = model(tokens, labels=labels).mean()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        finalize_model_grads([model], state)
        t3 = time.perf_counter()
        for p in params:
            p.grad = p.main_grad
        opt.step()
        t4 = time.perf_counter()
        for name, dt in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            phases[name] += dt
        value = loss.detach()
        if state.dp_size > 1:  # the global-batch mean, as the single process sees it
            dist.all_reduce(value, group=state.dp_group)
            value /= state.dp_size
        return value.item()

    def barrier():
        if dist.is_initialized():
            dist.barrier()

    first_loss = step()
    for _ in range(warmup - 1):
        step()
    times = []
    phases.update({name: 0.0 for name in phases})
    for _ in range(steps):
        barrier()
        start = time.perf_counter()
        step()
        barrier()
        times.append(time.perf_counter() - start)
    if rank == 0:
        results.put((first_loss, times, {k: v / steps for k, v in phases.items()}))
    if dist.is_initialized():
        dist.destroy_process_group()


def run_mode(mode, shape, global_batch, warmup, steps):
    procs, threads, tp = MODES[mode]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    workers = [ctx.Process(target=_worker, args=(r, procs, port, threads, tp, shape, global_batch, warmup, steps,
                                                 results)) for r in range(procs)]
    for w in workers:
        w.start()
    out = results.get(timeout=3600)
    for w in workers:
        w.join()
        if w.exitcode != 0:
            raise RuntimeError(f"{mode}: a worker exited with code {w.exitcode}")
    return out


def main(argv=None):
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=positive_int, default=3, help="timed steps per configuration run")
    p.add_argument("--warmup", type=positive_int, default=1, help="untimed steps first (>= 1)")
    p.add_argument("--rounds", type=positive_int, default=1, help="runs of every configuration (order mirrored)")
    p.add_argument("--global-batch-size", type=positive_int, default=4)
    p.add_argument("--small", action="store_true", help="a 2-layer, hidden-256 model (quick check)")
    args = p.parse_args(argv)
    dp = max(procs // tp for procs, _, tp in MODES.values())
    if args.global_batch_size < dp or args.global_batch_size % dp:
        p.error(f"--global-batch-size {args.global_batch_size}: a positive multiple of {dp} (DP={dp} splits it "
                f"evenly between its ranks; otherwise it trains on fewer sequences than the other configurations)")
    shape = SHAPES["small" if args.small else "full"]
    print(describe_machine(threads=2))
    print(f"model: {shape}, global batch {args.global_batch_size}, fp32, AdamW, dropout 0, "
          "DDP with overlapped bucket all-reduce, gloo")

    order = list(MODES)
    times = {m: [] for m in MODES}
    losses = {}
    for r in range(args.rounds):
        for mode in (order if r % 2 == 0 else order[::-1]):
            loss, t, ph = run_mode(mode, shape, args.global_batch_size, max(1, args.warmup), args.steps)
            losses[mode] = loss
            times[mode] += t
            procs, threads, tp = MODES[mode]
            print(f"  {mode}: {procs} process(es) x {threads} thread(s), tp {tp}, dp {procs // tp}: "
                  f"step times {', '.join(f'{x:.3f}' for x in t)} s, first-step loss {loss:.6f}\n"
                  f"    rank 0 mean per step: {', '.join(f'{k} {v:.3f} s' for k, v in ph.items())}", flush=True)

    base = statistics.median(times["base"])
    base1 = statistics.median(times["base1"])
    tokens = args.global_batch_size * shape["seq_length"]
    print(f"\n{'config':30} {'s/step (median)':>16} {'tokens/s':>10} {'efficiency':>11} {'vs 1 thread':>12}")
    for mode, label in (("base", "1 process x 2 threads"), ("base1", "1 process x 1 thread"),
                        ("tp2", "TP=2, 2 processes x 1 thread"), ("dp2", "DP=2, 2 processes x 1 thread")):
        t = statistics.median(times[mode])
        eff = f"{base / t:11.3f}" if mode in ("tp2", "dp2") else f"{'':11}"
        scaling = f"{base1 / (2 * t):12.3f}" if mode in ("tp2", "dp2") else ""
        print(f"{label:30} {t:16.3f} {tokens / t:10.1f} {eff} {scaling}")
    print("\nefficiency = t(1 process x 2 threads) / t(2 processes x 1 thread)   (target >= 0.85)")
    print("vs 1 thread = t(1 process x 1 thread) / (2 x t(2 processes x 1 thread)): strong scaling from one core,")
    print("  which a loaded machine disturbs less than a 2-thread process (its threads wait for each other)")
    spread = max(losses.values()) - min(losses.values())
    print(f"first-step loss agreement across configurations: max difference {spread:.2e}")


if __name__ == "__main__":
    main()
