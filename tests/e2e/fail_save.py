"""Run pretrain_gpt.py with checkpoint writes failing on one rank (for the save-failure tests).

    torchrun --nproc-per-node 2 tests/e2e/fail_save.py RANK FAULTS pretrain flags...

FAULTS is a comma-separated list of ``KIND@ITERATION``; on rank RANK only, the torch_dist save of
ITERATION fails the KIND way:

* ``checksums``: writing this rank's ``checksums/rank_XXXXX.pt`` fails with a full disk (before
  ``torch.distributed.checkpoint``'s collective save starts);
* ``piece``: writing this rank's pieces fails with a full disk (inside the collective save);
* ``error``: writing the checksums file raises a RuntimeError (an exception other than OSError);
* ``slow``: the background (``--async-save``) write of ITERATION starts 3 s late, so it is still in
  flight during the next iterations;
* ``token@B`` (B a batch number, not an iteration): this rank's B-th batch holds a token id beyond the
  vocabulary (tests/e2e/bad_batch_on_one_rank.py), an error this rank meets alone.

The other ranks write normally, as on a cluster where one node's disk fills up.
"""

import errno
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch.distributed.checkpoint as dcp  # noqa: E402

import megatron_lite.checkpoint.dist_save as dist_save  # noqa: E402
import pretrain_gpt  # noqa: E402
from tests.e2e.bad_batch_on_one_rank import corrupting  # noqa: E402


def _full(path):
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


def _install(kind: str, folder: str) -> None:
    """Make the save into ``folder`` (a temporary iteration folder) fail the ``kind`` way here."""
    if kind in ("checksums", "error"):
        save = dist_save.atomic_save

        def failing_save(obj, path):
            if path.startswith(folder + os.sep) and os.sep + "checksums" + os.sep in path:
                raise _full(path) if kind == "checksums" else RuntimeError("injected fault")
            save(obj, path)

        dist_save.atomic_save = failing_save
    elif kind == "slow":
        write = dist_save.write_pieces

        def late_write(pieces, target, group=None):
            if target == folder:
                time.sleep(3)
            write(pieces, target, group)

        dist_save.write_pieces = late_write
    elif kind == "piece":
        write = dcp.FileSystemWriter.write_data

        def failing_write(self, plan, planner):
            if os.fspath(self.path) == folder:
                raise _full(os.path.join(folder, "__1_0.distcp"))
            return write(self, plan, planner)

        dcp.FileSystemWriter.write_data = failing_write
    else:
        raise SystemExit(f"unknown fault {kind}")


def main(args=None):
    """``args``: RANK FAULTS flags... (default: this script's command line)."""
    args = sys.argv[1:] if args is None else args
    rank, faults, argv = int(args[0]), args[1], args[2:]
    if int(os.environ.get("RANK", "0")) == rank:
        root = argv[argv.index("--save") + 1]
        for fault in faults.split(","):
            kind, iteration = fault.split("@")
            if kind == "token":
                pretrain_gpt.checked_token_ids = corrupting(rank, int(iteration))
            else:
                _install(kind, dist_save.temp_dir(root, int(iteration)))
    pretrain_gpt.main(argv)


if __name__ == "__main__":
    from megatron_lite.errors import run_script

    run_script(main)
