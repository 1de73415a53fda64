"""``--result-rejected-tracker-filename``: the file listing every rejected result (Megatron-LM's
result-rejected tracker), and the iterations it says to skip.

One line per event and rank, in Megatron-LM's fields::

    ts=2026-11-29 22:50:01.5 node=gpu7 device=cuda:0 jobID=1234 rank=3 iteration=41 status=first_rerun_reproducible result=nan message='a NaN/inf loss or gradient'

``iteration`` counts from 0 as ``--iterations-to-skip`` does (41: the step logged as iteration 42);
``status`` is what happened: ``initial_run`` (the check failed on that rank: for a NaN/inf loss, the ranks whose loss it is), ``first_rerun_not_reproducible`` /
``first_rerun_reproducible`` (the rerun on the same hardware), ``second_rerun_not_reproducible`` /
``second_rerun_reproducible`` (the rerun on other hardware, after exit 16). Rank 0 rewrites the file
whole (under a temporary name, then renamed) with every rank's lines of a decision.

At start-up the file says which iterations to skip, by Megatron-LM's rule: an iteration whose result
was rejected and reproduced (``first_rerun_reproducible``, ``second_rerun_reproducible``, or
``rerun_disabled`` from a Megatron-LM run without reruns) twice on the same rank is skipped, unless
within one job (``jobID``: SLURM's, or ``N/A``) more than one rank rejected it.
"""

from __future__ import annotations

import datetime
import os
import re

import torch.distributed as dist

from ..console import print_rank_0
from ..errors import ConfigError
from ..files import replaced_whole

FLAG = "--result-rejected-tracker-filename"
LINE = re.compile(r"ts=.+ node=.+ device=.+ jobID=(\S+) rank=(\d+) iteration=(\d+) status=(\S+) result=.* message=.*")
REPRODUCED = ("rerun_disabled", "first_rerun_reproducible", "second_rerun_reproducible")
STATUSES = ("initial_run", "first_rerun_not_reproducible", "second_rerun_not_reproducible") + REPRODUCED


def job_id() -> str:
    return os.environ.get("SLURM_JOB_ID") or os.environ.get("SLURM_JOBID") or "N/A"


def tracker_line(where: tuple[str, str], rank: int, iteration: int, status: str, result, message: str) -> str:
    assert status in STATUSES, status
    return (f"ts={datetime.datetime.now()} node={where[0]} device={where[1]} jobID={job_id()} rank={rank} "
            f"iteration={iteration} status={status} result={result} message='{message}'")


def read_tracker(path: str) -> list[tuple[str, int, int, str]]:
    """(job, rank, iteration, status) of every line; a line of another shape is one ConfigError naming it."""
    if not os.path.exists(path):
        return []
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{FLAG} {path} cannot be read ({err}); fix or remove it") from None
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        match = LINE.search(line)
        status = match[4].split(".")[-1].lower() if match else ""  # Megatron-LM writes RerunValidationStatus.X too
        if status not in STATUSES:
            raise ConfigError(f"{FLAG} {path}:{number} is not a result-rejected tracker line ({line[:80]!r}); "
                              "fix or remove that line")
        rows.append((match[1], int(match[2]), int(match[3]), status))
    return rows


def iterations_to_skip(rows) -> tuple[list[int], list[int]]:
    """(the iterations to skip, those reproduced twice but rejected by several ranks of one job)."""
    seen, twice, by_job = set(), set(), {}
    for job, rank, iteration, status in rows:
        if status not in REPRODUCED:
            continue
        if (rank, iteration) in seen:
            twice.add(iteration)
        seen.add((rank, iteration))
        by_job.setdefault((job, iteration), set()).add(rank)
    several = {iteration for (_, iteration), ranks in by_job.items() if len(ranks) > 1}
    return sorted(twice - several), sorted(twice & several)


def tracker_skips(path: str | None) -> list[int]:
    """The iterations the tracker file says to skip (a line says which, and which it does not)."""
    if not path:
        return []
    skip, kept = iterations_to_skip(read_tracker(path))
    if skip:
        print_rank_0(f"> {FLAG} {path}: skipping iterations {skip} (their results were rejected and reproduced twice)")
    if kept:
        print_rank_0(f"> {FLAG} {path}: not skipping iterations {kept} (rejected on several ranks of one job)")
    return skip


def append_lines(path: str, lines: list[str]) -> None:
    """Every rank's ``lines`` (a collective when distributed), written by rank 0: the file rewritten whole."""
    if dist.is_initialized():
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, lines)
        lines = [line for part in gathered for line in part]
        if dist.get_rank() != 0:
            return
    if not lines:
        return
    old = ""
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            old = f.read()
    if old and not old.endswith("\n"):
        old += "\n"
    with replaced_whole(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(old + "".join(line + "\n" for line in lines))
