"""Progress of the long-running tools (megatron_lite/progress.py): a tqdm bar on a terminal only. With
stderr in a log file, tqdm wrote its carriage-return redraws there (tools/evaluate.py, the converter,
preprocess_sft, the lm-eval backend); now a plain line at most every 30 s, and no '\\r'."""

import io
import json
import os
import subprocess
import sys

from megatron_lite.progress import LogLines, progress
from tests.inference_helpers import prompts, save_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_bar_on_a_terminal_plain_lines_elsewhere_nothing_when_disabled():
    tty = _Terminal()
    assert list(progress(range(3), desc="windows", stream=tty)) == [0, 1, 2]
    assert "\r" in tty.getvalue()  # tqdm's bar
    log = io.StringIO()
    bar = progress(range(0, 10, 2), desc="windows", unit="batch", stream=log, interval=0)
    assert isinstance(bar, LogLines) and list(bar) == [0, 2, 4, 6, 8]
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue() and len(lines) == 5
    assert lines[2].startswith("windows: 3/5 batch (60%), ") and lines[2].endswith(" batch/s"), lines
    log = io.StringIO()
    with progress(total=3 * 2**20, unit="B", unit_scale=True, unit_divisor=1024, desc="conversations",
                  stream=log, interval=0) as bar:
        bar.set_postfix_str("12 docs/s")
        bar.update(2**20)
    assert log.getvalue().startswith("conversations: 1M/3M B (33%), ") and log.getvalue().endswith(", 12 docs/s\n")
    quiet = io.StringIO()
    for stream in (quiet, _Terminal()):
        bar = progress(range(4), stream=stream, enabled=False, interval=0)
        assert list(bar) == [0, 1, 2, 3]
        bar.update(1)
        bar.close()
        assert stream.getvalue() == ""
    assert list(progress(range(2), stream=log, interval=30)) == [0, 1]  # the default: at most every 30 s


def test_evaluate_with_stderr_in_a_log_file_writes_no_carriage_returns(tmp_path):
    """tools/evaluate.py 2> log: every tqdm redraw of the 'windows' bar stayed in the log."""
    ckpt = str(tmp_path / "ckpt")
    save_model("gpt", ckpt)
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": " ".join(map(str, d))}) + "\n"
                            for d in prompts(3, seed=4, lengths=(30, 17, 21))))
    with open(tmp_path / "log", "w") as log:
        done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "evaluate.py"), "--task", "WIKITEXT103",
                               "--load", ckpt, "--valid-data", str(data), "--seq-length", "16", "--overlapping-eval",
                               "1", "--micro-batch-size", "1"], stdout=subprocess.PIPE, stderr=log, text=True,
                              cwd=ROOT, timeout=300)
    text = (tmp_path / "log").read_bytes().decode()  # (read_text would turn '\r' into '\n')
    assert done.returncode == 0, text
    assert "validation results on WIKITEXT103" in done.stdout
    assert "\r" not in text, repr(text)
    assert len([line for line in text.splitlines() if line.startswith("windows:")]) <= 3, text
