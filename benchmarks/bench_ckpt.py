"""Checkpoint formats on CPU: save/load time and peak memory of torch vs torch_dist, and the training
time --async-save hides.

A GPT of about 124M parameters (12 layers, hidden 768, 12 heads, vocab 32768, seq 64) at DP 2 with
--use-distributed-optimizer (fp32, AdamW with its moments filled by one optimizer step).

1. Save and load, each format in its own fresh pair of processes (so one format's freed memory does
   not hide the other's): wall time and the peak RSS *increase* of each rank over its RSS just before
   the call, sampled every 2 ms by a thread (/proc/self/statm). The torch format gathers the
   distributed optimizer's full state onto every rank before rank 0 of each TP x PP position writes
   it; torch_dist writes each rank's own shard. Target: torch_dist's peak during save <= 0.6 x torch's.
2. --async-save: the same model trained 6 iterations with torch_dist saves at 2, 4 and 6 (the last
   one is waited for at exit), synchronous and async: the time the training loop is blocked in
   saves (plus the final wait), and each iteration's time (those overlapping a background write
   share the 2 cores with it).

    python benchmarks/bench_ckpt.py [--layers 12] [--out /tmp/bench_ckpt]
"""

from __future__ import annotations

import os
import queue
import shutil
import socket
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from benchmarks.common import OneLineParser, describe_machine, positive_int  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")


def model_args(layers: int) -> list[str]:
    return ["--num-layers", str(layers), "--hidden-size", "768", "--num-attention-heads", "12", "--seq-length", "64",
            "--max-position-embeddings", "64", "--vocab-size", "32768", "--mock-data", "--micro-batch-size", "1",
            "--global-batch-size", "2", "--lr", "1e-4", "--eval-iters", "0", "--log-interval", "100",
            "--use-distributed-optimizer", "--attention-dropout", "0", "--hidden-dropout", "0"]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakRSS:
    """The highest RSS seen while the block runs, sampled by a thread."""

    def __enter__(self):
        self.before = self.peak = _rss()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        self.start = time.perf_counter()
        return self

    def _sample(self):
        while not self.done.wait(0.002):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start
        self.done.set()
        self.thread.join()
        self.peak = max(self.peak, _rss())
        self.increase = self.peak - self.before


def _env(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), MEGATRON_LITE_DEVICE="cpu", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)


def save_load_rank(rank, world, port, argv, fmt, folder, results):
    _env(rank, world, port)
    import megatron_lite.training.loop as loop
    import pretrain_gpt
    from megatron_lite.arguments import parse_args
    from megatron_lite.checkpoint import load_checkpoint, save_checkpoint

    config = parse_args(argv + ["--ckpt-format", fmt, "--save", folder, "--load", folder], world_size=world)
    pretrain_gpt.set_vocab(config, pretrain_gpt.build_tokenizer_for(config))
    state, device = loop.setup(config)
    built = loop._build(config, state, device, pretrain_gpt.model_provider)  # nothing to load yet
    built.optimizer.step()  # Adam's moments exist (zero gradients), as after a real step
    params = sum(p.numel() for c in built.chunks for p in c.parameters())
    dist.barrier()
    with PeakRSS() as save:
        save_checkpoint(1, built.chunks, built.optimizer, built.scheduler, 2, config, state)
    dist.barrier()
    with PeakRSS() as load:
        load_checkpoint(built.chunks, built.optimizer, built.scheduler, config, state)
    dist.barrier()
    results.put((rank, params, save.seconds, save.increase, load.seconds, load.increase))
    dist.destroy_process_group()


def train_rank(rank, world, port, argv, results):
    """Train; time spent blocked in saves (and the final wait for an async one), and per iteration."""
    _env(rank, world, port)
    import megatron_lite.checkpoint.dist_save as dist_save
    import megatron_lite.training.loop as loop
    import pretrain_gpt

    blocked, steps, inside = [0.0], [], [False]
    save, wait, iteration = loop._Training.save, dist_save.AsyncSaves.wait, loop._Training.train_iteration

    def timed_save(self):
        start, inside[0] = time.perf_counter(), True
        save(self)
        inside[0] = False
        blocked[0] += time.perf_counter() - start

    def timed_wait(self, final=False):  # the loop's last call is wait(final=True)
        start = time.perf_counter()
        wait(self, final)
        if not inside[0]:  # the wait at the end of the run
            blocked[0] += time.perf_counter() - start

    def timed_iteration(self):
        start = time.perf_counter()
        iteration(self)
        steps.append(time.perf_counter() - start)

    loop._Training.save, dist_save.AsyncSaves.wait, loop._Training.train_iteration = timed_save, timed_wait, timed_iteration
    pretrain_gpt.main(argv)
    results.put((rank, blocked[0], steps))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ChildFailed(RuntimeError):
    """A child process ended (or ran out of time) before reporting its results."""


def spawn(fn, *args, world=2, timeout=1800.0) -> list:
    """``fn(rank, world, port, *args, results)`` in ``world`` fresh processes; their results, sorted.
    A child that dies first (a crash, an exception, killed) or the ``timeout`` is a ChildFailed, the
    other children stopped: the results are never waited for forever (a peer of a dead rank may wait
    in a collective until its own timeout)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=fn, args=(r, world, port, *args, results)) for r in range(world)]
    for p in procs:
        p.start()
    out, deadline = [], time.monotonic() + timeout
    try:
        while len(out) < len(procs):
            try:
                out.append(results.get(timeout=1.0))
                continue
            except queue.Empty:
                pass
            # a child's results are flushed before it exits: a silent second here means none are coming
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:
                raise ChildFailed(f"rank {dead[0][0]} of {fn.__name__} exited with code {dead[0][1]} before reporting "
                                  "its results (its output is above)")
            if all(p.exitcode is not None for p in procs):
                raise ChildFailed(f"{fn.__name__} ended without reporting the results of {len(procs) - len(out)} rank(s)")
            if time.monotonic() > deadline:
                raise ChildFailed(f"{fn.__name__} reported no results within {timeout:.0f} s")
    finally:
        for p in procs:
            if len(out) < len(procs) and p.is_alive():
                p.terminate()
            p.join()
    return sorted(out)


def main(argv=None):
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=positive_int, default=12)
    parser.add_argument("--out", default=None, help="scratch folder, kept (default: a temporary one, removed at the end)")
    parser.add_argument("--skip-async", action="store_true")
    parser.add_argument("--only-async", action="store_true")
    args = parser.parse_args(argv)
    if args.skip_async and args.only_async:
        parser.error("--skip-async with --only-async leaves nothing to run: give one of them")
    print(describe_machine(1))
    try:
        if args.out:
            return run(args, args.out)
        with tempfile.TemporaryDirectory(prefix="bench_ckpt_") as out:  # ~GBs of checkpoints: not left in /tmp
            return run(args, out)
    except ChildFailed as err:
        print(f"error: bench_ckpt.py: {err}; nothing more measured", file=sys.stderr, flush=True)
        sys.exit(1)


def run(args, out: str) -> None:
    base = model_args(args.layers)
    peaks = {}
    for fmt in () if args.only_async else ("torch", "torch_dist"):
        folder = os.path.join(out, fmt)
        shutil.rmtree(folder, ignore_errors=True)
        rows = spawn(save_load_rank, base, fmt, folder)
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs)
        peaks[fmt] = max(r[3] for r in rows)
        for rank, params, s_t, s_mem, l_t, l_mem in rows:
            print(f"{fmt:10s} rank {rank}: {params / 1e6:.1f}M params, save {s_t:6.2f} s peak +{s_mem / 2**20:7.0f} MiB, "
                  f"load {l_t:6.2f} s peak +{l_mem / 2**20:7.0f} MiB")
        print(f"{fmt:10s} on disk: {size / 2**20:.0f} MiB")
    if peaks:
        print(f"peak save memory torch_dist / torch: {peaks['torch_dist'] / peaks['torch']:.3f} (target <= 0.6)")
    if args.skip_async:
        return
    times = {}
    train = base + ["--train-iters", "6", "--lr-warmup-iters", "1", "--ckpt-format", "torch_dist", "--save-interval", "2"]
    for name, extra in (("sync", []), ("async", ["--async-save"])):
        folder = os.path.join(out, "train_" + name)
        shutil.rmtree(folder, ignore_errors=True)
        rows = spawn(train_rank, train + ["--save", folder] + extra)
        blocked = max(r[1] for r in rows)
        steps = [max(r[2][i] for r in rows) for i in range(len(rows[0][2]))]
        print(f"{name:6s}: blocked in saves {blocked:6.2f} s (3 saves); iteration times "
              + " ".join(f"{t:.2f}" for t in steps) + " s")
        times[name] = (blocked, steps)
    hidden = times["sync"][0] - times["async"][0]
    extra_steps = sum(times["async"][1]) - sum(times["sync"][1])
    print(f"training time hidden by --async-save: {hidden:.2f} s of {times['sync'][0]:.2f} s; the iterations "
          f"overlapping the writes took {extra_steps:+.2f} s more in total")


if __name__ == "__main__":
    main()
