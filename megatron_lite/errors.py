"""How a run ends: a user error in one line (exit 2), and a clean exit after success.

* An error every rank raises together (a bad flag, a checkpoint every rank refuses: the checkpoint
  code agrees on refusals across ranks first) is printed by global rank 0 only, and every rank
  exits with its code (:func:`exit_with_message`).
* A script's ``__main__`` is :func:`run_script`: after ``main()`` it ends the process groups while
  the interpreter is whole (:func:`~megatron_lite.device.shutdown_distributed`).
"""

from __future__ import annotations

import os
import sys
import time


class ConfigError(ValueError):
    """A bad flag or flag combination; the message names the flag and the fix."""


# torchrun stops every worker as soon as one exits with an error. The message is printed by rank 0
# only (once, not once per rank), so the other ranks wait this long before exiting: otherwise a
# fast rank 1 can get rank 0 killed before it has printed anything.
PEER_EXIT_GRACE_S = 5.0


def exit_with_message(message: str, code: int) -> None:
    """Exit with ``code``; ``message`` printed to stderr by global rank 0 only (see above)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(message, file=sys.stderr, flush=True)
    else:
        time.sleep(PEER_EXIT_GRACE_S)
    sys.exit(code)


def run_script(main) -> None:
    """A training script's ``__main__``: ``main()``, then the process groups are ended cleanly
    (:func:`~megatron_lite.device.shutdown_distributed`), then exit with ``main``'s exit code.

    Only a finished run or an exit every rank takes together (``SystemExit``) is ended this way; an
    unexpected exception propagates as is (its peers may be stuck in a collective, nothing to join).
    """
    from .device import shutdown_distributed

    code = 0
    try:
        main()
    except SystemExit as exc:
        code = exc.code or 0
    # after the except block: the run's objects (and its groups) are unreferenced. The barrier only
    # after success: an error exit may be one rank's (its peers must not wait for it there)
    shutdown_distributed(wait_for_peers=code == 0)
    sys.exit(code)
