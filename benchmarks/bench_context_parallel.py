"""Context parallelism on CPU: activation memory per rank, bytes moved per rank, step time.

1. Activation memory. A tiny-hidden GPT (2 layers, hidden 64, 4 heads, vocab 1024) at a long
   sequence (default 8192, micro-batch 1) runs one forward at CP 1, 2 and 4 (p2p ring). The
   activation memory of a rank is the bytes of the distinct tensors autograd saves for backward
   (parameters excluded), counted with saved-tensor hooks - deterministic, unlike a process's RSS.
   Target: about 1/cp of CP 1 (every activation is per token; the ring keeps no S x S score matrix).
2. Bytes moved by one core-attention call (forward + backward) per rank, counted by wrapping
   the torch.distributed calls, against the formulas (s = S/cp local tokens, e = element bytes,
   b batch, nq / nkv query / key-value heads, d head dim):
       p2p:       fwd (cp-1)*2*b*nkv*s*d*e;  bwd the same for K/V plus cp*2*b*nkv*s*d*4 (fp32 dK/dV)
       a2a:       fwd (cp-1)/cp * b*s*d*(2*nq + 2*nkv)*e (q, k, v in, output back); bwd the same
       allgather: fwd (cp-1)*2*b*nkv*s*d*e received; bwd the reduce-scatter of dK/dV, the same
3. Step time (forward + backward of the model) at CP 2 on 2 processes vs CP 1 on one process,
   one thread each. On a shared 2-core machine this is indicative only.

    python benchmarks/bench_context_parallel.py [--seq 8192] [--time-seq 4096] [--steps 3]
"""

from __future__ import annotations

import os
import queue
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from benchmarks.common import OneLineParser, describe_machine, positive_int  # noqa: E402

CPS = (1, 2, 4)  # the context-parallel sizes compared
SHAPE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=4, vocab_size=1024)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _saved_activation_bytes(model, run) -> int:
    """Bytes of the distinct non-parameter storages autograd saves while ``run()`` executes."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return sum(seen.values()), out


class _ByteCounter:
    """Counts bytes received by this rank through the collectives CP attention uses."""

    def __init__(self, dist):
        self.dist, self.total, self._saved = dist, 0, {}

    def __enter__(self):
        d = self.dist

        def batch(ops, _orig=d.batch_isend_irecv):
            self.total += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is d.irecv)
            return _orig(ops)

        def a2a(out, inp, *args, _orig=d.all_to_all_single, **kw):
            n = d.get_world_size(kw.get("group"))
            self.total += out.numel() * out.element_size() * (n - 1) // n
            return _orig(out, inp, *args, **kw)

        from megatron_lite.parallel import comm

        def gather(out, inp, *args, _orig=comm.all_gather_single, **kw):
            self.total += (out.numel() - inp.numel()) * out.element_size()
            return _orig(out, inp, *args, **kw)

        def scatter(out, inp, *args, _orig=comm.reduce_scatter_single, **kw):
            self.total += (inp.numel() - out.numel()) * inp.element_size()
            return _orig(out, inp, *args, **kw)

        for name, fn in (("batch_isend_irecv", batch), ("all_to_all_single", a2a)):
            self._saved[name] = getattr(d, name)
            setattr(d, name, fn)
        self._comm = (comm.all_gather_single, comm.reduce_scatter_single)
        comm.all_gather_single, comm.reduce_scatter_single = gather, scatter
        return self

    def __exit__(self, *exc):
        from megatron_lite.parallel import comm

        for name, fn in self._saved.items():
            setattr(self.dist, name, fn)
        comm.all_gather_single, comm.reduce_scatter_single = self._comm


def _formula(kind, cp, b, s, nq, nkv, d, e) -> tuple[int, int]:
    kv = 2 * b * nkv * s * d
    if kind == "p2p":
        return (cp - 1) * kv * e, (cp - 1) * kv * e + cp * kv * 4
    if kind == "a2a":
        one = (cp - 1) * b * s * d * (2 * nq + 2 * nkv) * e // cp
        return one, one
    return (cp - 1) * kv * e, (cp - 1) * kv * e


def _worker(rank, world, port, seq, time_seq, steps, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), MEGATRON_LITE_DEVICE="cpu")
    torch.set_num_threads(1)
    import torch.distributed as dist

    from megatron_lite.device import init_distributed
    from megatron_lite.models import GPTModel, TransformerConfig
    from megatron_lite.parallel.context import ContextParallelAttention, split_for_cp
    from megatron_lite.parallel.random import model_parallel_seed
    from megatron_lite.parallel.state import ParallelState

    if world > 1:
        init_distributed()
    state = ParallelState(cp=world)
    out = {}

    def model_at(length):
        cfg = TransformerConfig(**SHAPE, seq_length=length, attention_dropout=0.0, hidden_dropout=0.0,
                                context_parallel_size=world, position_embedding_type="rope")
        model_parallel_seed(1234, state)
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, cfg.vocab_size, (1, length), generator=gen)
        local = split_for_cp(tokens, 1, state.cp_rank, world)
        return GPTModel(cfg, state), local, torch.roll(local, -1, 1)

    model, tokens, labels = model_at(seq)
    out["activation_bytes"], _ = _saved_activation_bytes(model, lambda: model(tokens, labels=labels).sum())
    del model

    if world > 1:  # bytes moved by one core-attention call, each comm type
        b, nq, nkv, d, s = 1, 8, 4, 16, seq // world
        for kind in ("p2p", "a2a", "allgather"):
            cfg = TransformerConfig(**dict(SHAPE, num_attention_heads=nq, num_query_groups=nkv), seq_length=seq,
                                    context_parallel_size=world,
                                    cp_comm_type=kind, attention_dropout=0.0)
            attn = ContextParallelAttention(cfg, state, 1)
            q, k, v = (torch.randn(s, b, n, d, requires_grad=True) for n in (nq, nkv, nkv))
            with _ByteCounter(dist) as fwd:
                o = attn(q, k, v, None, True)
            with _ByteCounter(dist) as bwd:
                o.backward(torch.ones_like(o))
            out[kind] = (fwd.total, bwd.total, _formula(kind, world, b, s, nq, nkv, d, 4))

    if time_seq and world <= 2:
        model, tokens, labels = model_at(time_seq)
        times = []
        for _ in range(steps + 1):
            if world > 1:
                dist.barrier()
            start = time.perf_counter()
            model(tokens, labels=labels).mean().backward()
            if world > 1:
                dist.barrier()
            times.append(time.perf_counter() - start)
        out["step_s"] = sorted(times[1:])[len(times[1:]) // 2]  # median, first step is warm-up
    if rank == 0:
        results.put(out)
    if world > 1:
        dist.destroy_process_group()


def run(world, seq, time_seq, steps) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, seq, time_seq, steps, results)) for r in range(world)]
    for p in procs:
        p.start()
    while True:  # a worker that dies (e.g. out of memory) must not leave us waiting forever
        try:
            out = results.get(timeout=5)
            break
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                raise RuntimeError(f"cp {world}: a worker failed (see its traceback above)") from None
    for p in procs:
        p.join()
    return out


def main():
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=positive_int, default=8192)
    parser.add_argument("--time-seq", type=positive_int, default=4096)
    parser.add_argument("--steps", type=positive_int, default=3)
    args = parser.parse_args()
    for flag, seq in (("--seq", args.seq), ("--time-seq", args.time_seq)):
        if seq < 2 * CPS[-1] or seq % (2 * CPS[-1]):
            parser.error(f"{flag} {seq}: a positive multiple of {2 * CPS[-1]} (CP {CPS[-1]} cuts the sequence into "
                         f"2 x {CPS[-1]} equal chunks)")
    print(describe_machine(threads=1))
    print(f"model: {SHAPE}, RoPE, micro-batch 1, seq {args.seq} (memory), {args.time_seq} (time), fp32\n")
    results = {cp: run(cp, args.seq, args.time_seq, args.steps) for cp in CPS}
    base = results[1]["activation_bytes"]
    print("activation memory per rank (saved tensors, parameters excluded)")
    for cp, r in results.items():
        mib = r["activation_bytes"] / 2**20
        print(f"  cp {cp}: {mib:9.1f} MiB   CP1 / this = {base / r['activation_bytes']:.2f} (ideal {cp})")
    print("\nbytes received per rank by one core-attention call (b 1, 8 query / 4 kv heads, d 16, fp32)")
    for cp in (2, 4):
        for kind in ("p2p", "a2a", "allgather"):
            fwd, bwd, (f_fwd, f_bwd) = results[cp][kind]
            print(f"  cp {cp} {kind:9s}: forward {fwd:10d} (formula {f_fwd:10d})   backward {bwd:10d} (formula {f_bwd:10d})")
    if "step_s" in results[2]:
        t1, t2 = results[1]["step_s"], results[2]["step_s"]
        print(f"\nforward+backward at seq {args.time_seq}: cp 1 (1 process) {t1:.3f} s, cp 2 (2 processes) {t2:.3f} s, "
              f"speed-up {t1 / t2:.2f} (ideal 2)")


if __name__ == "__main__":
    main()
