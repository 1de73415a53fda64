"""Multi-rank test harness: real process groups, spawned once and reused across tests.

``run_ranks(world_size, fn, *args)`` runs the module-level function ``fn(*args)`` on every rank
of a pool of ``world_size`` worker processes with ``torch.distributed`` initialised (gloo on CPU;
NCCL with ``MEGATRON_LITE_TEST_DEVICE=cuda`` and a GPU per rank) and returns the per-rank results in rank order. An exception on any
rank fails the test with that rank's traceback; a hang kills the pool (a fresh one is started for
the next test) and fails with a timeout. Pools for 2, 4 and 8 ranks live for the whole session;
their workers are forked from a server that imported torch once (:func:`_context`).

Inside workers, :func:`cached_state` returns a :class:`ParallelState` per shape, so the process
groups of a shape are created once per pool rather than once per test.
"""

from __future__ import annotations

import atexit
import importlib
import multiprocessing as mp
import os
import queue
import socket
import sys
import tempfile
import traceback

TIMEOUT_S = float(os.environ.get("MEGATRON_LITE_TEST_TIMEOUT", 300))
ERROR_GRACE_S = 20.0


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a rendezvous or torchrun's --master-port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, tasks, results) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), OMP_NUM_THREADS="1",
    )
    import torch

    torch.set_num_threads(1)
    # gloo on CPU by default. MEGATRON_LITE_TEST_DEVICE=cuda runs the pool on NCCL (a GPU per rank);
    # the test bodies build CPU tensors, so that mode is for tests written device-aware.
    if os.environ.get("MEGATRON_LITE_TEST_DEVICE", "cpu") != "cuda" or torch.cuda.device_count() < world_size:
        os.environ["MEGATRON_LITE_DEVICE"] = "cpu"
    from megatron_lite.device import init_distributed

    try:
        init_distributed(timeout_minutes=TIMEOUT_S / 60)
    except Exception:
        results.put((rank, False, traceback.format_exc()))
        return
    while True:
        task = tasks.get()
        if task is None:
            break
        path, module_name, fn_name, args, kwargs = task
        for entry in path:
            if entry not in sys.path:
                sys.path.append(entry)
        try:
            fn = getattr(importlib.import_module(module_name), fn_name)
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - report everything to the parent
            results.put((rank, False, traceback.format_exc()))
    import torch.distributed as dist

    dist.destroy_process_group()


def _context():
    """Workers are forked from a server process that imported torch and Dynamo (which
    init_distributed imports before making the group) once, rather than spawned fresh, each importing
    them again (~4 s of CPU per worker: an 8-rank pool took 20 s to start on 2 loaded cores). The
    server imports nothing else and runs no thread, so each fork starts clean; where a platform has
    no forkserver, workers are spawned."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch._dynamo"])
    return ctx


class RankPool:
    def __init__(self, world_size: int):
        ctx = _context()
        self.world_size = world_size
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        port = free_port()
        self.procs = [
            ctx.Process(target=_worker, args=(r, world_size, port, self.tasks[r], self.results), daemon=True)
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn, *args, **kwargs):
        path = [p for p in sys.path if p]
        task = (path, fn.__module__, fn.__name__, args, kwargs)
        for q in self.tasks:
            q.put(task)
        out, errors = [None] * self.world_size, []
        for _ in range(self.world_size):
            # once a rank has failed, the others are likely stuck in a collective: give them a moment
            try:
                rank, ok, value = self.results.get(timeout=ERROR_GRACE_S if errors else TIMEOUT_S)
            except queue.Empty:
                self.close(kill=True)
                if errors:
                    raise AssertionError(f"{fn.__name__} failed on a rank (the others were stuck, pool restarted):\n"
                                         + "\n".join(errors)) from None
                raise TimeoutError(f"{fn.__name__} did not finish on {self.world_size} ranks in {TIMEOUT_S:.0f} s") from None
            if ok:
                out[rank] = value
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
        if errors:
            raise AssertionError(f"{fn.__name__} failed on {len(errors)} rank(s):\n" + "\n".join(sorted(errors)))
        return out

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self, kill: bool = False) -> None:
        for p, q in zip(self.procs, self.tasks):
            if not kill and p.is_alive():
                q.put(None)
        for p in self.procs:
            p.join(timeout=0 if kill else 10)
            if p.is_alive():
                p.kill()


_POOLS: dict[int, RankPool] = {}


def run_ranks(world_size: int, fn, *args, **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return the results in rank order."""
    pool = _POOLS.get(world_size)
    if pool is None or not pool.alive():
        if pool is not None:
            pool.close(kill=True)
        pool = _POOLS[world_size] = RankPool(world_size)
    try:
        return pool.run(fn, *args, **kwargs)
    finally:
        if not pool.alive():
            _POOLS.pop(world_size, None)


@atexit.register
def _close_all() -> None:
    for pool in _POOLS.values():
        pool.close()


# ---------------------------------------------------------------------------------------------
# One process of its own, without a process group.

_LAUNCH_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def run_in_new_process(fn, *args, env: dict | None = None, timeout: float = TIMEOUT_S) -> tuple[int, str, str]:
    """``fn(*args)`` (a module-level function) in a new single process forked from the pools' server
    (torch already imported), ``env`` added to its environment: (exit code, stdout, stderr). The exit
    code is ``-N`` for a process ended by signal N (-9: SIGKILL), as for ``subprocess``. For what a
    process dying or being killed leaves behind; such a process ends without interpreter
    finalisation, so what happens at a normal exit needs a real ``python`` launch."""
    with tempfile.TemporaryDirectory() as folder:
        out, err = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
        proc = _context().Process(target=_new_process_main, daemon=True, args=(
            [p for p in sys.path if p], fn.__module__, fn.__name__, args, dict(env or {}), out, err))
        proc.start()
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
            raise TimeoutError(f"{fn.__name__} did not finish in {timeout:.0f} s")
        with open(out) as o, open(err) as e:
            return proc.exitcode, o.read(), e.read()


def _new_process_main(path, module_name, fn_name, args, env, out, err) -> None:
    for name in _LAUNCH_ENV:  # the server's environment is the test session's at its start
        os.environ.pop(name, None)
    os.environ.update(env)
    for entry in path:
        if entry not in sys.path:
            sys.path.append(entry)
    for fd, name in ((1, out), (2, err)):
        target = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    getattr(importlib.import_module(module_name), fn_name)(*args)


# ---------------------------------------------------------------------------------------------
# Helpers for code running inside a worker.

_STATES: dict = {}


def cached_state(**sizes):
    """The ParallelState of this shape for this worker, created once (group creation is collective)."""
    from megatron_lite.parallel.state import ParallelState

    key = tuple(sorted(sizes.items()))
    if key not in _STATES:
        _STATES[key] = ParallelState(**sizes)
    return _STATES[key]
