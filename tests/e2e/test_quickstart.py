"""The README's main command, run as a user runs it: ``bash examples/quickstart_cpu.sh``, shortened.

tests/unit/test_hand_run_scripts.py checks its flags; this runs every step (corpus, tokenizer,
preprocess, TP2 x PP2 training on 4 processes, generation, loss curve) and checks what the README
promises: exit code 0, the loss going down, a sample generated, the curve drawn, the checkpoint saved.
"""

import os
import re
import subprocess

from tests.e2e.conftest import ROOT

ITERS = 12  # shorter than the warm-up of the default run (20 of 300): the script scales it with ITERS


def test_quickstart_script_trains_and_generates(tmp_path):
    out = tmp_path / "quickstart"
    env = dict(os.environ, OUT=str(out), ITERS=str(ITERS))
    run = subprocess.run(["bash", "examples/quickstart_cpu.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    curve = re.search(rf"lm loss ([\d.]+) at 1 -> ([\d.]+) at {ITERS}, validation ([\d.]+) at {ITERS}", run.stdout)
    assert curve, run.stdout[-3000:]
    first, last, valid = map(float, curve.groups())
    assert last < first - 1.0 and valid < first - 1.0, curve.group(0)  # 7.52 -> 5.77 (validation 5.90) here
    sample = run.stdout.split("== 5. generate")[1].split("== 6. loss curve")[0].splitlines()[1:]
    text = "\n".join(sample)
    assert text.startswith("The for statement is used to") and len(text.strip()) > len("The for statement is used to")
    assert (out / "loss.png").stat().st_size > 1000
    assert (out / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)
