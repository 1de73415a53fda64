"""How a run ends: a user error in one line (exit 2) on every rank, and a clean exit after success.

* An error every rank raises together (a bad flag, a checkpoint every rank refuses: the checkpoint
  code agrees on refusals across ranks first) is printed by global rank 0 only, and every rank
  exits with its code (:func:`exit_with_message`).
* An error one rank may see alone: inside the training loop the ranks are not in step (one rank's
  batch holds a bad token id while the others wait for it in a collective). The loop marks such
  errors (:func:`rank_local_errors`); the rank posts its message to the job's key-value store (the
  one torchrun / ``init_process_group`` already run; the first message posted wins), prints it and
  ends at once. Its closed connections fail the collectives the others wait in; each of them finds
  the message there (:func:`exit_if_a_peer_stopped`) and exits with the same code without printing.
  No collective is added to the steps: the store is read only after a collective has failed. Where
  rank 0's process hosts the store (a launch without torchrun's agent, e.g. srun with MASTER_ADDR),
  rank 0 closes its connections first and stays until every rank has read the store (at most
  :data:`STORE_HOST_WAIT_S`).
* A script's ``__main__`` is :func:`run_script`: after ``main()`` it ends the process groups while
  the interpreter is whole (:func:`~megatron_lite.device.shutdown_distributed`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time


class ConfigError(ValueError):
    """A bad flag or flag combination; the message names the flag and the fix."""


# torchrun stops every worker as soon as one exits with an error. The message of an error every
# rank raises is printed by rank 0 only (once, not once per rank), so the other ranks wait this long
# before exiting: otherwise a fast rank 1 can get rank 0 killed before it has printed anything.
PEER_EXIT_GRACE_S = 5.0
_STORE_KEY = "megatron_lite/rank_error"  # "<exit code> <message>" of the first rank that stopped alone
_SEEN_KEY = "megatron_lite/rank_error_seen"  # how many ranks have ended on it
STORE_HOST_WAIT_S = 30.0
INTERRUPTED_EXIT_CODE = 130  # a shell's code for a process stopped by SIGINT (128 + 2)


def exit_with_message(message: str, code: int, rank_local: bool = False) -> None:
    """Exit with ``code``, ``message`` printed to stderr once.

    ``rank_local`` False (every rank raised the error): global rank 0 prints it, the others wait
    :data:`PEER_EXIT_GRACE_S` first. True (this rank may be alone, see the module docstring): the
    message goes to the job's store and this rank ends at once (``os._exit``: an interpreter exit
    would wait for the collectives in flight, which wait for the ranks that wait for this one).
    """
    store = _store() if rank_local else None
    if store is not None:
        first = _post(store, f"{code} {message}")
        _end_now(store, code, message if first else None)  # a second rank's error: the first message stands
    if int(os.environ.get("RANK", "0")) == 0:
        print(message, file=sys.stderr, flush=True)
    else:
        time.sleep(PEER_EXIT_GRACE_S)
    sys.exit(code)


def exit_if_a_peer_stopped() -> None:
    """After a failed collective: if another rank stopped on its own error (posted to the store), exit
    with its code at once and silently (that rank printed the message); otherwise return."""
    store = _store()
    if store is None:
        return
    try:
        if not store.check([_STORE_KEY]):
            return
        code, _ = store.get(_STORE_KEY).decode().split(" ", 1)
    except Exception:  # noqa: BLE001 - the store is gone too: report the failure itself
        return
    _end_now(store, int(code), None)


@contextlib.contextmanager
def rank_local_errors():
    """Inside, the ranks are not in step: an error escaping (a rank's bad batch) may be this rank's
    alone; it is marked so (unless :func:`raised_on_every_rank` marked it) for :func:`exit_with_message`."""
    try:
        yield
    except Exception as err:
        if not getattr(err, "on_every_rank", False):
            err.rank_local = True
        raise


def raised_on_every_rank(err: Exception) -> Exception:
    """Mark ``err`` as raised by every rank together (agreed), so it takes the ordinary exit."""
    err.on_every_rank = True
    return err


def is_rank_local(err: BaseException) -> bool:
    return getattr(err, "rank_local", False)


def run_script(main) -> None:
    """A training script's ``__main__``: ``main()``, then the process groups are ended cleanly
    (:func:`~megatron_lite.device.shutdown_distributed`), then exit with ``main``'s exit code.

    Only a finished run or an exit every rank takes together (``SystemExit``) is ended this way; an
    unexpected exception propagates as is (its peers may be stuck in a collective, nothing to join).
    Ctrl-C (``KeyboardInterrupt``, which Ctrl-C raises on every rank of the terminal's torchrun) is
    one line on rank 0, with the training loop's ``where`` (what was saved), and exit code 130.
    """
    from .device import shutdown_distributed

    code = 0
    try:
        main()
    except SystemExit as exc:
        code = exc.code or 0
    except KeyboardInterrupt as exc:  # Ctrl-C: one line, not a traceback per rank
        code = INTERRUPTED_EXIT_CODE
        if int(os.environ.get("RANK", "0")) == 0:
            where = getattr(exc, "where", None)
            print(f"interrupted (Ctrl-C){': ' + where if where else ''}", file=sys.stderr, flush=True)
    # after the except block: the run's objects (and its groups) are unreferenced. The barrier only
    # after success: an error exit may be one rank's (its peers must not wait for it there)
    shutdown_distributed(wait_for_peers=code == 0)
    sys.exit(code)


SIGPIPE_EXIT_CODE = 141  # 128 + SIGPIPE: what a shell reports for a program whose reader went away


def run_tool(main) -> int:
    """A tool's ``__main__``: ``main()``'s exit code, or, when the reader of its output went away
    (``tool ... | head -1``), a quiet exit instead of a BrokenPipeError traceback. SIGPIPE is not given
    back its default action (that would also kill a server whose client hung up): the error is caught,
    and stdout pointed at /dev/null so the interpreter's last flush has nowhere to fail."""
    try:
        code = main()
        sys.stdout.flush()  # the output still buffered fails here, not in the interpreter's exit
        return code
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return SIGPIPE_EXIT_CODE


def _store():
    """The job's key-value store when more than one process runs and the run made the process group
    (a test's process pool owns its group, and its workers must not end at once), else None."""
    try:
        import torch.distributed as dist

        from .device import owns_process_group

        if not (owns_process_group() and dist.get_world_size() > 1):
            return None
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store: the caller falls back to the plain exit
        return None


def _post(store, value: str) -> bool:
    """Post ``value`` unless a value is there already; whether this one is the one posted."""
    try:
        return store.compare_set(_STORE_KEY, "", value).decode() == value
    except Exception:  # noqa: BLE001
        return True


def _end_now(store, code: int, message: str | None) -> None:
    """Print ``message`` (if any) and end this process at once, counted out in the store. The process
    hosting the store first lets the others fail and read it (see the module docstring)."""
    if message is not None:
        print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        seen = store.add(_SEEN_KEY, 1)
        if _hosts_store():
            import torch.distributed as dist

            world = dist.get_world_size()
            _close_connections()
            deadline = time.monotonic() + STORE_HOST_WAIT_S
            while seen < world and time.monotonic() < deadline:
                time.sleep(0.05)
                seen = store.add(_SEEN_KEY, 0)
    except Exception:  # noqa: BLE001 - a store that fails now: end anyway
        pass
    os._exit(code)


def _hosts_store() -> bool:
    """Whether this process serves the job's store: rank 0, unless torchrun's agent serves it."""
    import torch.distributed as dist

    return dist.get_rank() == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"


def _close_connections() -> None:
    """Let this process's groups go (in a daemon thread: a group whose destructor waits for a
    collective that never completes must not hold the exit up), so that its peers' collectives fail
    now: the run's objects are dropped with the frames of the exception being handled."""
    import gc
    import threading
    import traceback

    import torch.distributed as dist

    from .parallel.state import forget_groups

    error = sys.exc_info()[1]
    if error is not None:
        traceback.clear_frames(error.__traceback__)

    def release():
        dist.destroy_process_group()
        forget_groups()
        gc.collect()

    threading.Thread(target=release, daemon=True).start()


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors (unknown flag, invalid choice, bad value, missing value) are
    one line and exit code 2, without the usage block (``--help`` shows that)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (--help lists the flags)\n")

    def parse_known_args(self, args=None, namespace=None):
        # A Megatron-LM value of one of this tool's flags that we do not take (--tokenizer-type TikTokenizer):
        # the line training gives (why, and what to use), not argparse's bare "invalid choice" list
        from megatron_lite.megatron_flags import megatron_value_message

        message = megatron_value_message(list(sys.argv[1:] if args is None else args))
        if message is not None and message.split(" ", 1)[0] in self._option_string_actions:
            self.error(message)
        return super().parse_known_args(args, namespace)
