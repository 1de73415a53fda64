"""tools/plot_loss.py reads what TrainLogger writes (console lines and TensorBoard) and draws a PNG."""

import os
import sys

import pytest

from megatron_lite.config import Config
from megatron_lite.parallel.state import ParallelState
from megatron_lite.training.logging import TrainLogger

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from tests.tools import load_tool  # noqa: E402
from tools import plot_loss  # noqa: E402


def _run(tmp_path, capsys):
    cfg = Config()
    cfg.logging.log_interval = 2
    cfg.logging.tensorboard_dir = str(tmp_path / "tb")
    log = TrainLogger(cfg, ParallelState(), 1e9)
    for it in range(1, 7):
        log.log_iteration(it, {"lm loss": 10.0 - it}, 1e-3, 1.0, 1.0, False, False, 0.1, 2)
        if it == 4:
            log.log_validation(it, {"lm loss": 5.5})
    log.close()
    (tmp_path / "run.log").write_text("some startup line\n" + capsys.readouterr().out)


def test_reads_console_log_and_tensorboard(tmp_path, capsys):
    _run(tmp_path, capsys)
    train, valid, test = plot_loss.read_run(str(tmp_path / "run.log"))
    assert train == [(2, 8.5), (4, 6.5), (6, 4.5)]  # interval means of 9,8 / 7,6 / 5,4
    assert valid == {None: [(4, 5.5)]} and test == []
    train, valid, test = plot_loss.read_run(str(tmp_path / "tb"))
    assert train == [(i, 10.0 - i) for i in range(1, 7)]
    assert valid == {None: [(4, 5.5)]} and test == []


def test_writes_png_and_rejects_empty_input(tmp_path, capsys):
    _run(tmp_path, capsys)
    out = tmp_path / "loss.png"
    assert plot_loss.main([str(tmp_path / "run.log"), str(tmp_path / "tb"), "-o", str(out),
                           "--labels", "log", "tb"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the line says whether the loss went down (the README's quickstart ends with it)
    assert capsys.readouterr().out.strip() == (
        f"wrote {out} (log: 3 points, lm loss 8.500 at 2 -> 4.500 at 6, validation 5.500 at 4; "
        "tb: 6 points, lm loss 9.000 at 1 -> 4.000 at 6, validation 5.500 at 4)")
    (tmp_path / "empty.log").write_text("nothing here\n")
    assert plot_loss.main([str(tmp_path / "empty.log"), "-o", str(tmp_path / "x.png")]) == 2
    assert "no 'lm loss' values" in capsys.readouterr().err


def test_creates_the_output_folder(tmp_path, capsys):
    _run(tmp_path, capsys)
    out = tmp_path / "missing" / "dir" / "loss.png"
    assert plot_loss.main([str(tmp_path / "run.log"), "-o", str(out)]) in (0, None)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert os.listdir(out.parent) == ["loss.png"]


def test_a_resumed_run_appended_to_the_log_takes_the_later_values(tmp_path, capsys):
    """A run resumed from iteration 2 and logging to the same file (tee -a) repeats iterations 4 and 6: each
    iteration is one point, the resumed run's, in order (the line went back from 6 to 4)."""
    _run(tmp_path, capsys)
    first = (tmp_path / "run.log").read_text()
    resumed = first.replace("lm loss: 6.5", "lm loss: 6.25").replace("lm loss value: 5.5", "lm loss value: 5.25")
    resumed = resumed[resumed.index("iteration        4/") - 23:]  # from the resumed run's first line on
    (tmp_path / "run.log").write_text(first + resumed)
    train, valid, _ = plot_loss.read_run(str(tmp_path / "run.log"))
    assert train == [(2, 8.5), (4, 6.25), (6, 4.5)]
    assert valid == {None: [(4, 5.25)]}


def _sets_run(tmp_path, capsys, names, ppl=False):
    """A --multiple-validation-sets run (sets ``names``, validated at 2 and 4) ending with its test pass."""
    cfg = Config()
    cfg.logging.log_interval = 1
    cfg.logging.tensorboard_dir = str(tmp_path / "tb")
    cfg.logging.log_validation_ppl_to_tensorboard = ppl
    log = TrainLogger(cfg, ParallelState(), 1e9)
    for it in range(1, 5):
        log.log_iteration(it, {"lm loss": 10.0 - it}, 1e-3, 1.0, 1.0, False, False, 0.1, 2)
        if it % 2 == 0:
            for i, name in enumerate(names):
                log.log_validation(it, {"lm loss": it + i / 4}, name=name)  # exact in float32
    log.log_validation(4, {"lm loss": 3.25}, prefix="iteration 4 on test set", scalars=False)
    log.close()
    (tmp_path / "run.log").write_text(capsys.readouterr().out)


@pytest.mark.parametrize("ppl", [False, True])
def test_each_validation_set_is_a_series_and_the_test_pass_a_point(tmp_path, capsys, ppl):
    """--multiple-validation-sets lines (" validation loss at iteration N on validation set NAME |") and the
    test line were skipped: each set is its own series (from the log and from the ``lm loss validation NAME``
    scalars, without their ``... ppl`` ones; a set named ``ppl`` or with a space in its name is a set), and
    the test pass a point (log only: it has no scalar)."""
    names = ["web", "ppl", "two words"]
    _sets_run(tmp_path, capsys, names, ppl)
    want = {name: [(2, 2 + i / 4), (4, 4 + i / 4)] for i, name in enumerate(names)}
    log = plot_loss.read_run(str(tmp_path / "run.log"))
    assert log.valid == want and log.test == [(4, 3.25)] and len(log.train) == 4
    tb = plot_loss.read_run(str(tmp_path / "tb"))
    assert tb.valid == want and tb.test == [] and len(tb.train) == 4
    out = tmp_path / "loss.png"
    assert plot_loss.main([str(tmp_path / "run.log"), "-o", str(out), "--labels", "log"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert capsys.readouterr().out.strip() == (
        f"wrote {out} (log: 4 points, lm loss 9.000 at 1 -> 6.000 at 4, validation ppl 4.250 at 4, "
        "validation two words 4.500 at 4, validation web 4.000 at 4, test 3.250 at 4)")


def test_the_plain_validation_ppl_scalar_is_not_a_set(tmp_path, capsys):
    """--log-validation-ppl-to-tensorboard without --multiple-validation-sets writes ``lm loss validation ppl``:
    the perplexity of the one validation split, not a set named ``ppl``."""
    _sets_run(tmp_path, capsys, [None], ppl=True)
    assert plot_loss.read_run(str(tmp_path / "tb")).valid == {None: [(2, 2.0), (4, 4.0)]}


@pytest.mark.parametrize("tool", ["plot_loss", "plot_schedule", "plan"])
@pytest.mark.parametrize("place", ["folder", "under a file"])
def test_an_unwritable_image_path_is_refused_before_the_work(tmp_path, capsys, tool, place):
    """An image path that is a folder, or under a file: each tool ended in a traceback (IsADirectoryError,
    FileExistsError) after its work (the planner after printing its table); now one line naming the flag, exit 2."""
    _run(tmp_path, capsys)
    (tmp_path / "a_file").write_text("")
    path = str(tmp_path) if place == "folder" else str(tmp_path / "a_file" / "x.png")
    flag, argv = {"plot_loss": ("--output", [str(tmp_path / "run.log")]),
                  "plot_schedule": ("--out", ["-p", "2", "-m", "2"]),
                  "plan": ("--png", ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                                     "--seq-length", "16", "--vocab-size", "100", "--gpus", "8",
                                     "--global-batch-size", "8"])}[tool]
    try:
        code = load_tool(tool).main(argv + [flag, path])
    except SystemExit as err:
        code = err.code
    captured = capsys.readouterr()
    assert code == 2 and captured.out == "", captured
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and f"{flag} {path}" in lines[0], lines
    assert ("is a folder" if place == "folder" else "a_file is a file, not a folder") in lines[0], lines


@pytest.mark.parametrize("tool", ["plot_loss", "plot_schedule", "plan"])
def test_a_write_that_fails_after_the_check_leaves_no_temporary_file(tmp_path, capsys, monkeypatch, tool):
    """savefig failing half-way (a full disk, after the up-front check passed) left ``<image>.tmp.png``
    behind and ended in a traceback; now the temporary file is removed, the old image is untouched and
    the tool says so in one line naming the flag, exit 2."""
    import errno

    from matplotlib.figure import Figure

    _run(tmp_path, capsys)
    out_dir = tmp_path / "images"
    out_dir.mkdir()
    image = out_dir / "x.png"
    image.write_bytes(b"the previous image")

    def full_disk(fig, fname, **kwargs):
        with open(fname, "wb") as f:
            f.write(b"\x89PNG half")
        raise OSError(errno.ENOSPC, "No space left on device", str(fname))

    monkeypatch.setattr(Figure, "savefig", full_disk)
    flag, argv = {"plot_loss": ("--output", [str(tmp_path / "run.log")]),
                  "plot_schedule": ("--out", ["-p", "2", "-m", "2"]),
                  "plan": ("--png", ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                                     "--seq-length", "16", "--vocab-size", "100", "--gpus", "8",
                                     "--global-batch-size", "8"])}[tool]
    try:
        code = load_tool(tool).main(argv + [flag, str(image)])
    except SystemExit as err:
        code = err.code
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert f"{flag} {image}" in lines[0] and "No space left on device" in lines[0], lines
    assert sorted(os.listdir(out_dir)) == ["x.png"] and image.read_bytes() == b"the previous image"


def test_save_figure_without_a_flag_removes_its_temporary_file_and_re_raises(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from megatron_lite.training.outputs import save_figure

    def interrupted(fig, fname, **kwargs):
        with open(fname, "wb") as f:
            f.write(b"half")
        raise KeyboardInterrupt

    fig = Figure()
    monkeypatch.setattr(Figure, "savefig", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_figure(fig, str(tmp_path / "a.svg"))
    monkeypatch.setattr(Figure, "savefig", lambda *a, **k: (_ for _ in ()).throw(OSError(28, "No space")))
    with pytest.raises(OSError, match="No space"):
        save_figure(fig, str(tmp_path / "a.svg"))
    assert os.listdir(tmp_path) == []
