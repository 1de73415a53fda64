"""Soak: launch small torchrun jobs many times and count the ones that do not end cleanly.

A finished run must exit 0 on every launch. The failure this guards against is rare and depends on
timing (a gloo worker thread freeing a collective's tensor while the interpreter finalises: SIGABRT
"terminate called without an active exception", or a hang at exit), so it takes many launches, and
a loaded machine, to see it. Each configuration trains a tiny model a few steps, saves, and exits;
every launch is classified by its exit: ok, SIGABRT (with the message), another signal or code, or
a hang (killed after ``--timeout``).

The control pair shows that the soak can see the failure: a script that leaves asynchronous
all-reduces in flight at exit, once ending through ``megatron_lite.errors.run_script`` (the process
groups ended cleanly, as pretrain_gpt.py does) and once left to interpreter exit (as before).

    python benchmarks/bench_soak.py                      # 50 launches of each configuration
    python benchmarks/bench_soak.py --launches 5 --configs control_clean control_raw
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.common import OneLineParser, describe_machine, positive_float, positive_int  # noqa: E402
from megatron_lite.progress import progress  # noqa: E402

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--mock-data", "--vocab-size", "100", "--micro-batch-size", "2", "--log-interval", "1", "--eval-iters", "0",
        "--train-iters", "6"]
CONFIGS = {
    "ep2_shared_expert": (2, TINY + ["--global-batch-size", "4", "--expert-model-parallel-size", "2",
                                     "--num-experts", "4", "--moe-router-topk", "2",
                                     "--moe-shared-expert-intermediate-size", "32",
                                     "--moe-token-dispatcher-type", "alltoall", "--disable-bias-linear"]),
    "zero3_dp2_overlap": (2, TINY + ["--global-batch-size", "4", "--data-parallel-sharding-strategy",
                                     "optim_grads_params", "--overlap-grad-reduce", "--overlap-param-gather"]),
    "tp2_pp2": (4, TINY + ["--global-batch-size", "8", "--tensor-model-parallel-size", "2",
                           "--pipeline-model-parallel-size", "2"]),
    "control_clean": (2, None),
    "control_raw": (2, None),
}
CONTROL = """
import sys
import torch
import torch.distributed as dist
from megatron_lite.device import init_distributed
from megatron_lite.errors import run_script

def main():
    init_distributed()
    sub = dist.new_group([0, 1])
    for group in (sub, None) * 10:
        t = torch.ones(1 << 14)
        t.kind = "a tensor with Python state"
        dist.all_reduce(t, group=group, async_op=True)
        del t

if sys.argv[1] == "clean":
    run_script(main)
else:
    main()
"""


def signature(returncode: int | None, stderr: str) -> str:
    """One word or phrase for how a launch ended."""
    if returncode == 0:
        return "ok"
    if returncode is None:
        return "hang (killed at the timeout)"
    if "terminate called without an active exception" in stderr:
        return "SIGABRT: terminate called without an active exception"
    for line in stderr.splitlines():
        if "exitcode" in line and ":" in line and "exitcode  : 0" not in line:
            return "worker " + line.strip().replace("  ", " ")
    return f"torchrun exit {returncode}"


def launch(name: str, workdir: str, timeout: float) -> str:
    world, argv = CONFIGS[name]
    run = tempfile.mkdtemp(dir=workdir)
    if argv is None:  # the controls
        script = os.path.join(run, "control.py")
        with open(script, "w") as f:
            f.write(CONTROL)
        target = [script, name.split("_")[1]]
    else:
        target = [os.path.join(ROOT, "pretrain_gpt.py")] + argv + ["--save", os.path.join(run, "ckpt")]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)] + target
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen(cmd, cwd=run, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=timeout)
        return signature(proc.returncode, stderr)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        return signature(None, "")


def main() -> None:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launches", type=positive_int, default=50, help="launches per configuration")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--parallel", type=positive_int, default=2, help="launches at a time (more load, sooner done)")
    parser.add_argument("--timeout", type=positive_float, default=900.0, help="seconds before a launch counts as hung")
    args = parser.parse_args()
    print(describe_machine(threads=1))
    start = time.time()
    counts = {name: collections.Counter() for name in args.configs}
    jobs = [name for _ in range(args.launches) for name in args.configs]  # interleaved: the same load for each
    with tempfile.TemporaryDirectory() as workdir, ThreadPoolExecutor(args.parallel) as pool:
        results = pool.map(lambda name: (name, launch(name, workdir, args.timeout)), jobs)
        for name, sig in progress(results, total=len(jobs), desc="launches"):
            counts[name][sig] += 1
    print(f"\n{len(jobs)} launches in {(time.time() - start) / 60:.1f} min, {args.parallel} at a time; "
          f"load average now {os.getloadavg()[0]:.1f}")
    print(f"{'configuration':<20} {'launches':>8} {'abnormal':>8}  signatures")
    for name, counter in counts.items():
        bad = sum(n for sig, n in counter.items() if sig != "ok")
        sigs = "; ".join(f"{n} x {sig}" for sig, n in counter.most_common() if sig != "ok") or "-"
        print(f"{name:<20} {sum(counter.values()):>8} {bad:>8}  {sigs}")


if __name__ == "__main__":
    main()
