"""``python exit_threads.py SCRIPT ARGS...``: run a training script as its ``__main__`` (as torchrun
does) and, at interpreter exit, write the names of the threads this process still has to
``$EXIT_THREADS_DIR/rank<RANK>``. A communication thread alive there can abort a finished run
(see megatron_lite.device.shutdown_distributed); atexit handlers run once the interpreter starts to
finalise, after Python's own non-daemon threads were joined."""

import atexit
import os
import runpy
import sys


def _report() -> None:
    names = []
    for task in sorted(os.listdir("/proc/self/task")):
        with open(f"/proc/self/task/{task}/comm") as f:
            names.append(f.read().strip())
    path = os.path.join(os.environ["EXIT_THREADS_DIR"], f"rank{os.environ.get('RANK', '0')}")
    with open(path, "w") as f:
        f.write("\n".join(names))


if __name__ == "__main__":
    atexit.register(_report)
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
