"""Long-run stability: 1,000 tiny training steps with a checkpoint every 50 keep memory and open files flat.

    python benchmarks/bench_long_run.py [--iters 1000] [--save-interval 50]

Runs ``pretrain_gpt.py`` (one process, CPU, dropout on, mock data) and, at every log line (every 50
steps), reads the process's current resident memory (VmRSS) and its number of open file descriptors
from /proc (Linux only). Passes when the RSS at the last step is within 5% of the RSS at step 100
and the open-file count at the end is no higher than at step 100 (so --iters is at least 150).
"""

import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.common import OneLineParser, describe_machine, positive_int  # noqa: E402

BASE_ITER, LOG_INTERVAL = 100, 50  # the step compared against, and how often memory is read
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--vocab-size", "128", "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--eval-iters", "0", "--lr", "1e-3"]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def verdict(samples: list[tuple[int, float, int]]) -> tuple[bool, str]:
    """(passed, the summary line) of ``(iteration, RSS MB, open fds)`` samples: the last against the
    first at or after :data:`BASE_ITER`."""
    base = next(s for s in samples if s[0] >= BASE_ITER)
    last = samples[-1]
    growth = (last[1] - base[1]) / base[1]
    ok = abs(growth) <= 0.05 and last[2] <= base[2]
    return ok, (f"RSS step {last[0]} vs step {base[0]}: {growth:+.1%}; open files {base[2]} -> {last[2]}: "
                f"{'PASS' if ok else 'FAIL'}")


def main(argv=None) -> int:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=1000)
    p.add_argument("--save-interval", type=positive_int, default=50)
    args = p.parse_args(argv)
    if args.iters < BASE_ITER + LOG_INTERVAL:
        p.error(f"--iters {args.iters}: at least {BASE_ITER + LOG_INTERVAL} (the memory of the last step is "
                f"compared with step {BASE_ITER}'s, read every {LOG_INTERVAL} steps)")
    print(describe_machine(threads=1))
    samples = []
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "pretrain_gpt.py", *TINY, "--train-iters", str(args.iters), "--save",
               os.path.join(tmp, "ckpt"), "--save-interval", str(args.save_interval), "--log-interval", str(LOG_INTERVAL)]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MEGATRON_LITE_DEVICE="cpu")
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
        for line in proc.stdout:
            m = re.search(r"iteration +(\d+)/", line)
            if m:
                samples.append((int(m.group(1)), rss_mb(proc.pid), open_files(proc.pid)))
        if proc.wait() != 0:
            print(f"pretrain_gpt.py exited with {proc.returncode}")
            return 1
    print(f"{'iteration':>9} {'RSS (MB)':>9} {'open fds':>8}")
    for it, rss, fds in samples:
        print(f"{it:>9} {rss:>9.1f} {fds:>8}")
    ok, line = verdict(samples)
    print(line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
