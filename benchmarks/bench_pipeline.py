#!/usr/bin/env python3
"""1F1B, interleaved 1F1B (v=2) and ZB-H1 at p=4 on CPU: measured bubble fraction and step time.

Four gloo processes (one thread each) run the real schedules on a balanced toy MLP (8 layers of
ColumnParallelLinear(h, 4h) -> GELU -> RowParallelLinear(4h, h) at TP 1, 2 per rank; interleaved:
2 chunks of 1 layer per rank; ZB-H1 defers both GEMMs' weight gradients) for m in {4, 8}
micro-batches, side by side in the same processes. Each rank records the wall-clock
time of every forward/backward (trace); the measured bubble fraction is the time each rank spends
outside forward/backward during the step (first rank's start to last rank's end: waiting on
neighbours, communication) over the time it spends inside, summed over ranks — the quantity the
formulas (p-1)/m, (p-1)/(v*m) and, with T_F = T_B = T_W, (p-1)/(3m) (ZB-H1) estimate for free
communication. Interleaving sends v times as
many messages, so on a slow link its measured bubble sits further above its formula.
Beside them, from what ran: "W share" (the part of the backward time
spent in W ops: about half under ZB-H1, 0 if nothing was deferred) and "replayed" (the op order each
rank recorded, laid out with each op kind's measured mean time and free communication: the bubble
the schedule that really ran implies, without the noise of waiting). The equal-cost simulation of
the predicted op order (F = B = W) is the last column.

Caveat: with fewer cores than processes, ranks compete for cores, so measured bubbles mix
pipeline idling with scheduling noise; the machine line says how many cores there were and the
load, and "compute ms/rank" (the same work in every row) shows how much the op times themselves
were stretched.

A second run replaces the MLP by fixed-time layers (sleep: forward 20 ms per stage, backward
40 ms; under ZB-H1 the backward is B 20 ms + a deferred W 20 ms) so that stage costs are exactly
equal and no rank competes for a core: that run measures the schedules and their communication
against the formulas on any machine.

    python benchmarks/bench_pipeline.py [--work compute|sleep|both] [--hidden 256] [--tokens 512] [--iters 5]
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

P, LAYERS = 4, 8
SCHEDULES = [("1F1B", 1, "1f1b"), ("interleaved v=2", 2, "1f1b"), ("ZB-H1", 1, "zb-h1")]  # name, v, --pipeline-schedule


def _mlp_chunk(start, end, hidden, pre, post):
    import torch
    from torch import nn

    from megatron_lite.parallel.tensor import ColumnParallelLinear, RowParallelLinear

    class Chunk(nn.Module):
        def __init__(self):
            super().__init__()
            self.pre, self.post, self.input_tensor = pre, post, None
            self.layers = nn.ModuleList()
            for i in range(start, end):
                torch.manual_seed(i)
                self.layers.append(nn.Sequential(ColumnParallelLinear(hidden, 4 * hidden), nn.GELU(),
                                                 RowParallelLinear(4 * hidden, hidden)))

        def set_input_tensor(self, x):
            self.input_tensor = x

        def forward(self, x):
            h = x if self.pre else self.input_tensor
            for layer in self.layers:
                h = h + layer(h)
            return h

    return Chunk()


def _sleep_chunk(start, end, forward_s, pre, post):
    """Layers that take a fixed time (forward ``forward_s``, backward twice that) without using a
    core: stage costs are exactly equal, whatever the number of cores. Under the zero-bubble
    schedule (a weight-gradient store installed) the backward is B = ``forward_s`` plus a deferred
    W = ``forward_s``."""
    import torch
    from torch import nn

    class Sleep(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, holder):
            ctx.w, ctx.holder = w, holder
            time.sleep(forward_s)
            return x * w

        @staticmethod
        def backward(ctx, grad):
            store, w = ctx.holder.store, ctx.w
            dw = grad.sum().reshape(1)
            if store is not None and store.collecting:
                time.sleep(forward_s)

                def weight_pass():
                    time.sleep(forward_s)
                    return [(w, dw)]

                store.defer(weight_pass)
                return grad, None, None
            time.sleep(2 * forward_s)
            return grad, dw, None

    class Chunk(nn.Module):
        def __init__(self):
            super().__init__()
            self.pre, self.post, self.input_tensor = pre, post, None
            self.w = nn.ParameterList([nn.Parameter(torch.ones(1)) for _ in range(start, end)])
            self.store = None

        def set_weight_grad_store(self, store):
            self.store = store

        def set_input_tensor(self, x):
            self.input_tensor = x

        def forward(self, x):
            h = x if self.pre else self.input_tensor
            for w in self.w:
                h = Sleep.apply(h, w, self)
            return h

    return Chunk()


def _worker(rank, port, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(P),
                      OMP_NUM_THREADS="1", MEGATRON_LITE_DEVICE="cpu")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from megatron_lite.device import init_distributed
    from megatron_lite.parallel.pipeline import PipeComm, get_forward_backward_func, layer_ranges
    from megatron_lite.parallel.pipeline.trace import Event, Trace
    from megatron_lite.parallel.state import ParallelState

    init_distributed()
    seq, batch = args.tokens // 4, 4
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(seq, batch, args.hidden, generator=gen), torch.randn(seq, batch, args.hidden, generator=gen)

    def forward_step(data_iterator, chunk):
        out = chunk(x if chunk.pre else None)
        return out, lambda h: (((h - y) ** 2).mean(), {})

    from megatron_lite.parallel.pipeline.trace import measured_bubble_fraction

    setups = {}
    for name, v, schedule in SCHEDULES:
        state = ParallelState(pp=P, vpp=v if v > 1 else None)
        ranges = layer_ranges(LAYERS, P, LAYERS // (P * v) if v > 1 else None)[state.pp_rank]
        flags = [(state.is_first_stage() and c == 0, state.is_last_stage() and c == len(ranges) - 1)
                 for c in range(len(ranges))]
        if args.work == "sleep":  # forward of a whole stage (LAYERS / P layers) = sleep_ms
            per_layer = args.sleep_ms / 1e3 / (LAYERS // P)
            chunks = [_sleep_chunk(a, b, per_layer, *f) for (a, b), f in zip(ranges, flags)]
        else:
            chunks = [_mlp_chunk(a, b, args.hidden, *f) for (a, b), f in zip(ranges, flags)]
        comm = PipeComm.for_activations(state, seq_length=seq, micro_batch_size=batch, hidden_size=args.hidden,
                                        dtype=torch.float32)
        setups[name] = (v, comm, chunks, get_forward_backward_func(state, schedule))
    configs = [(name, m) for m in (4, 8) for name, _, _ in SCHEDULES]
    steps = {c: [] for c in configs}
    bubbles = {c: [] for c in configs}
    busy = {c: [] for c in configs}  # mean time per rank inside forward/backward (same work in every config)
    w_share = {c: [] for c in configs}  # share of the backward time spent in W ops (0: nothing was deferred)
    replay = {c: [] for c in configs}  # bubble of the recorded op order replayed with the measured op costs
    # alternate the configurations within each iteration so that load changes hit all of them
    for it in range(args.warmup + args.iters):
        for name, m in configs:
            v, comm, chunks, fb = setups[name]
            for c in chunks:
                c.zero_grad(set_to_none=True)
            trace = Trace()
            dist.barrier()
            t0 = time.perf_counter()
            fb(forward_step_func=forward_step, data_iterator=[None] * v if v > 1 else None, model=chunks,
               num_microbatches=m, comm=comm, trace=trace)
            t1 = time.perf_counter()
            gathered = [None] * P
            dist.all_gather_object(gathered, (list(trace), trace.times, t0, t1))
            if it < args.warmup:
                continue
            # every rank is charged the whole step (first start to last end), as in the formulas
            step_span = (min(g[2] for g in gathered), max(g[3] for g in gathered))
            full, spans = Trace(), {}
            for events, times, _, _ in gathered:
                full.extend(Event(*e) for e in events)
                full.times.extend(times)
                spans[events[0][0]] = step_span
            bubbles[(name, m)].append(measured_bubble_fraction(full, spans))
            busy[(name, m)].append(sum(b - a for a, b in full.times) / P)
            share, bubble = _replay(full, v)
            w_share[(name, m)].append(share)
            replay[(name, m)].append(bubble)
            steps[(name, m)].append(max(b for _, _, _, b in gathered) - min(a for _, _, a, _ in gathered))
    rows = [(name, m, *(statistics.median(x[c]) for x in (steps, bubbles, busy, w_share, replay)))
            for c in configs for name, m in [c]]
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def _replay(full, v):
    """From what ran: the share of backward time spent in W ops, and the bubble of the recorded op
    order of every rank laid out with each kind's measured mean cost (free communication)."""
    from megatron_lite.parallel.pipeline.trace import bubble_fraction, orders_from_trace, simulate

    spent: dict[str, list[float]] = {}
    for event, (a, b) in zip(full, full.times):
        spent.setdefault(event.kind, []).append(b - a)
    w, backward = sum(spent.get("W", [])), sum(spent["B"]) + sum(spent.get("W", []))
    cost = {k: statistics.mean(t) for k, t in spent.items()}
    timeline = simulate(orders_from_trace(full), P, v, cost["F"], cost["B"], cost.get("W", 0.0))
    return w / backward, bubble_fraction(timeline)


def main(argv=None) -> int:
    from benchmarks.common import OneLineParser, describe_machine, positive_int

    ap = OneLineParser(description="1F1B vs interleaved 1F1B vs ZB-H1 at p=4 on CPU")
    ap.add_argument("--hidden", type=positive_int, default=256)
    ap.add_argument("--tokens", type=positive_int, default=512, help="tokens per micro-batch (seq x 4)")
    ap.add_argument("--iters", type=positive_int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--work", choices=["compute", "sleep", "both"], default="both",
                    help="compute: real MLP layers; sleep: fixed-time layers (equal stage costs on any core count)")
    ap.add_argument("--sleep-ms", type=float, default=20.0, help="forward time of one stage in --work sleep")
    args = ap.parse_args(argv)
    if args.tokens < 4 or args.tokens % 4:
        ap.error(f"--tokens {args.tokens}: a positive multiple of 4 (a micro-batch is 4 sequences of tokens / 4)")
    print(describe_machine(threads=1))
    for work in (["compute", "sleep"] if args.work == "both" else [args.work]):
        args.work = work
        run(args)
    return 0


def run(args) -> None:

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, args, queue)) for r in range(P)]
    for p in procs:
        p.start()
    rows = queue.get(timeout=1800)
    for p in procs:
        p.join()

    what = (f"toy MLP {LAYERS} layers, hidden {args.hidden}" if args.work == "compute" else
            f"fixed-time layers: stage forward {args.sleep_ms:g} ms, backward {2 * args.sleep_ms:g} ms (sleep; "
            f"ZB-H1: B {args.sleep_ms:g} + W {args.sleep_ms:g})")
    print(f"\n[{args.work}] p={P} gloo processes x 1 thread; {what}, {args.tokens} tokens per micro-batch; "
          f"median of {args.iters} steps after {args.warmup} warmup")
    print(f"{'schedule':<16}{'m':>3}{'step ms':>10}{'compute ms/rank':>17}{'W share':>9}{'bubble measured':>17}"
          f"{'replayed':>10}{'formula':>9}{'equal-cost sim':>16}")
    by = {}
    for name, m, step, bubble, work, share, replayed in rows:
        formula, sim = _formula_and_sim(name, m)
        print(f"{name:<16}{m:>3}{step * 1e3:>10.1f}{work * 1e3:>17.1f}{share:>9.2f}{bubble:>17.3f}{replayed:>10.3f}"
              f"{formula:>9.3f}{sim:>16.3f}")
        by[(name, m)] = (step, bubble)
    for m in (4, 8):
        (s1, b1), (s2, b2), (s3, b3) = (by[(name, m)] for name, _, _ in SCHEDULES)
        print(f"m={m}: step time / 1F1B: interleaved {s2 / s1:.2f}, ZB-H1 {s3 / s1:.2f}; measured bubble / 1F1B: "
              f"interleaved {b2 / b1:.2f} (formula 0.50), ZB-H1 {b3 / b1:.2f} (formula 0.33, target <= 0.50)")


def _formula_and_sim(name, m):
    """Bubble formula and the equal-cost simulation of the same op order (F = B = W = 1 per stage)."""
    from megatron_lite.parallel.pipeline.trace import bubble_fraction, simulate, simulated_orders

    v = dict((n, vv) for n, vv, _ in SCHEDULES)[name]
    if name == "ZB-H1":
        return (P - 1) / (3 * m), bubble_fraction(simulate(simulated_orders(P, m, 1, "zb-h1"), P, 1, 1.0, 1.0, 1.0))
    return (P - 1) / (v * m), bubble_fraction(simulate(simulated_orders(P, m, v), P, v, 1.0 / v, 2.0 / v))


if __name__ == "__main__":
    sys.exit(main())
