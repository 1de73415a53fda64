#!/usr/bin/env python3
"""Mutation probe: break one line of the library at a time and check that the suite notices.

Each mutation (listed in ``tests/mutation_list.py``, ``tests/mutation_list_features.py`` and
``tests/mutation_list_inference_finetune.py``) is a bug the suite once missed or caught only
late (issue 26, and the sweep of the parallel core, MoE routing, LR schedule, resume, MLA/MTP and SFT
masks that followed), or a guard of a reduction the parallel core depends on. For each one this script copies the repository
to a scratch folder, applies the one edit there (the text to replace must occur exactly ``count``
times), runs the tests named for it with the scratch copy first on ``PYTHONPATH`` and reports
``caught`` (some test failed), ``missed`` (all passed) or ``error`` (the tests could not run:
collection error, the edit no longer applies). The first assertion line of each failing test is
printed, so "caught at step 1" can be read off it.

Not part of the pytest run (the file name does not start with ``test_``)::

    python tests/mutations.py                 # every mutation
    python tests/mutations.py zb_h1 cp_scale  # some of them
    python tests/mutations.py --control       # also run the tests unmutated (they must pass)
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

from mutation_list import COMBINED, Mutation  # tests/, this script's folder (run as a script)
from mutation_list import MUTATIONS as CORE
from mutation_list_features import MUTATIONS as FEATURES
from mutation_list_inference_finetune import MUTATIONS as DECODE_TUNE

MUTATIONS = CORE + FEATURES + DECODE_TUNE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COPY = ["megatron_lite", "tests", "tools", "pretrain_gpt.py", "pretrain_bert.py", "pyproject.toml"]


def _scratch() -> str:
    folder = tempfile.mkdtemp(prefix="mutation-")
    for name in COPY:
        src = os.path.join(ROOT, name)
        if os.path.isdir(src):
            shutil.copytree(src, os.path.join(folder, name), ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, folder)
    return folder


def _apply(folder: str, m: Mutation) -> None:
    path = os.path.join(folder, m.path)
    with open(path) as f:
        text = f.read()
    found = text.count(m.old)
    if found != m.count:
        raise ValueError(f"{m.name}: {m.path} holds the text to replace {found} times, expected {m.count}")
    with open(path, "w") as f:
        f.write(text.replace(m.old, m.new))


def _run_tests(folder: str, tests: tuple[str, ...]) -> tuple[int, str]:
    env = dict(os.environ, PYTHONPATH=folder, OMP_NUM_THREADS="1", COLUMNS="1000")  # untruncated summaries
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-rf", *tests]
    out = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True)
    return out.returncode, out.stdout + out.stderr


def _failures(log: str) -> list[str]:
    """``test id: first assertion line`` of each failed test in a pytest log."""
    lines = []
    for line in log.splitlines():
        if line.startswith("FAILED "):
            lines.append(re.sub(r"\s+", " ", line[len("FAILED "):])[:300])
    return lines


def probe(m: Mutation, control: bool) -> str:
    folder = _scratch()
    try:
        if control:
            rc, log = _run_tests(folder, m.tests)
            if rc != 0:
                return f"error: the tests fail unmutated (rc {rc})\n{log[-3000:]}"
        for part in [m] + [x for x in MUTATIONS if x.name in COMBINED.get(m.name, [])]:
            _apply(folder, part)
        start = time.time()
        rc, log = _run_tests(folder, m.tests)
        took = f"{time.time() - start:.0f} s"
        if rc == 0:
            return f"MISSED ({took}): every test passed"
        if rc != 1:
            return f"error (rc {rc}, {took}): the tests did not run\n{log[-3000:]}"
        return f"caught ({took}) by:\n" + "\n".join(f"    {line}" for line in _failures(log))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="mutations to probe (default: all)")
    ap.add_argument("--control", action="store_true", help="first run each mutation's tests unmutated")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTATIONS if m.tests and (not args.names or m.name in args.names)]
    missed = 0
    for m in chosen:
        print(f"[{m.name}] {m.what}\n  tests: {' '.join(m.tests)}", flush=True)
        verdict = probe(m, args.control)
        missed += not verdict.startswith("caught")
        print(f"  {verdict}", flush=True)
    print(f"{len(chosen) - missed} of {len(chosen)} mutations caught")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
