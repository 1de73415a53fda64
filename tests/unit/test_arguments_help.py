"""--help shows Megatron's usual form: ``--num-layers N`` with ``(default: ...)``, not internal names;
the defaults are Megatron-LM's where it has one."""

import glob
import os

import pytest

from megatron_lite.arguments import build_parser, parse_args
from tests.cli_errors import parse_refused
from tests.tools import load_tool

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_help_shows_metavars_and_defaults():
    text = build_parser().format_help()
    assert "--num-layers N" in text and "--lr X" in text
    assert "MODEL." not in text and "OPTIM." not in text and "TRAINING." not in text
    assert "Number of transformer layers. (default: 2)" in text
    assert "--no-check-for-nan-in-loss-and-grad" in text


def test_megatron_defaults():
    config = parse_args(["--mock-data", "--vocab-size", "64"], world_size=1)
    assert config.optim.lr_decay_style == "linear"
    assert config.logging.log_interval == 100
    assert config.training.check_for_nan_in_loss_and_grad
    assert not parse_args(["--mock-data", "--vocab-size", "64", "--no-check-for-nan-in-loss-and-grad"],
                          world_size=1).training.check_for_nan_in_loss_and_grad


def _list_fields():
    """(flag, section class, field) of every list-typed config field the CLI builds."""
    import dataclasses
    import typing

    from megatron_lite.config import SECTIONS, Config

    hints = typing.get_type_hints(Config)
    out = []
    for section in SECTIONS:
        cls = hints[section]
        for f in dataclasses.fields(cls):
            kind = typing.get_type_hints(cls)[f.name]
            if f.metadata.get("cli", True) and "list[" in str(kind):
                out.append("--" + f.name.replace("_", "-"))
    return out


def test_every_list_flag_takes_several_values():
    flags = _list_fields()
    assert {"--moe-router-load-balancing-type", "--moe-aux-loss-coeff", "--cp-comm-type", "--data-path"} <= set(flags)
    actions = {a.option_strings[0]: a for a in build_parser()._actions if a.option_strings}
    fixed = {"--spec": 2, "--rampup-batch-size": 3,  # --spec MODULE NAME, --rampup-batch-size START INCREMENT SAMPLES
             "--window-size": 2}  # --window-size LEFT RIGHT
    for flag in flags:  # those take exactly that many (their fields say so in their metadata)
        assert actions[flag].nargs == fixed.get(flag, "+"), flag
    config = parse_args(["--mock-data", "--vocab-size", "64", "--num-experts", "4",
                         "--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss",
                         "--moe-aux-loss-coeff", "1e-2", "1e-3", "--num-layers", "2", "--cp-comm-type", "p2p", "a2a"],
                        world_size=1)
    assert config.moe.moe_router_load_balancing_type == ["aux_loss", "seq_aux_loss"]
    assert config.moe.moe_aux_loss_coeff == [1e-2, 1e-3]
    assert config.parallel.cp_comm_type == ["p2p", "a2a"]


BASE = ["--mock-data", "--vocab-size", "64"]


def _one_line_exit_2(capsys, argv, *words, world_size=1):
    return parse_refused(capsys, BASE + argv, *words, world_size=world_size)


@pytest.mark.parametrize("argv, words", [
    (["--no-such-flag"], ["unrecognized arguments: --no-such-flag"]),
    (["--optimizer", "lamb"], ["--optimizer", "invalid choice: 'lamb'"]),
    (["--num-layers", "four"], ["--num-layers", "invalid int value"]),
    (["--lr"], ["--lr", "expected one argument"]),
])
def test_argparse_errors_are_one_line(capsys, argv, words):
    line = _one_line_exit_2(capsys, argv, *words)
    assert "usage:" not in line


TOOLS = sorted(os.path.relpath(p, ROOT)[len("tools/"):-3] for p in glob.glob(os.path.join(ROOT, "tools", "**", "*.py"),
                                                                          recursive=True))


@pytest.mark.parametrize("tool", TOOLS)
def test_every_tool_says_a_bad_flag_in_one_line(capsys, tool):
    """Every script under tools/ (those added later too): a flag it does not have is one line, exit 2."""
    module = load_tool(tool)
    capsys.readouterr()
    with pytest.raises(SystemExit) as err:
        module.main(["--no-such-flag", "1"])
    assert err.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0] and "usage:" not in lines[0], lines


@pytest.mark.parametrize("argv, words", [
    (["--cp-comm-type", "a2a+p2p", "--context-parallel-size", "2"], ["a2a+p2p needs --hierarchical-context-parallel"]),
    (["--moe-router-fusion", "--num-experts", "2", "--expert-model-parallel-size", "2"], ["--moe-router-fusion"]),
])
def test_not_built_is_said_before_asking_for_more_processes(capsys, argv, words):
    """In one process, a feature that is not built is refused as such, not with 'launch more processes'."""
    line = _one_line_exit_2(capsys, argv, *words)
    assert "world size" not in line


def test_a_layout_that_needs_more_processes_still_says_so(capsys):
    _one_line_exit_2(capsys, ["--tensor-model-parallel-size", "2"], "world size 1 is not divisible")


@pytest.mark.parametrize("hidden", [32, 64, 96, 128, 1000, 4096, 8192])
def test_swiglu_ffn_default_is_megatrons(hidden):
    """--swiglu without --ffn-hidden-size: int((4h x 2/3) / 64) x 64 (Megatron-LM's rule); GeLU keeps 4h."""
    config = parse_args(BASE + ["--swiglu", "--hidden-size", str(hidden), "--num-attention-heads", "4"], world_size=1)
    assert config.model.ffn_hidden_size == int((4 * hidden * 2 / 3) / 64) * 64
    gelu = parse_args(BASE + ["--hidden-size", str(hidden), "--num-attention-heads", "4"], world_size=1)
    assert gelu.model.ffn_hidden_size == 4 * hidden
    given = parse_args(BASE + ["--swiglu", "--hidden-size", str(hidden), "--num-attention-heads", "4",
                               "--ffn-hidden-size", "100"], world_size=1)
    assert given.model.ffn_hidden_size == 100


def test_swiglu_default_of_zero_is_refused(capsys):
    """Below hidden 24 Megatron's rule gives 0: refused, naming the flag to set."""
    _one_line_exit_2(capsys, ["--swiglu", "--hidden-size", "16", "--num-attention-heads", "4"],
                     "ffn-hidden-size 0", "set --ffn-hidden-size")
    config = parse_args(BASE + ["--swiglu", "--hidden-size", "24", "--num-attention-heads", "4"], world_size=1)
    assert config.model.ffn_hidden_size == 64


def _deliberate_default_rows():
    """(flags, values) of the rows of training.md's table of deliberate differences whose first cell
    names only flags and whose "here" cell gives one value (a number or a `word`) per flag: the defaults
    we chose."""
    import re

    with open(os.path.join(ROOT, "docs", "training.md")) as f:
        lines = f.read().split("| flag or behaviour | here | Megatron-LM | why |", 1)[1].splitlines()[2:]
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        first, here = [c.strip() for c in line.strip().strip("|").split("|")][:2]
        flags = re.findall(r"(--[a-z][\w-]*)", first)
        values = [v.strip() for v in here.split(",")]
        if (flags and re.fullmatch(r"(`?--[a-z][\w-]*`?[ ,]*)+", first) and len(flags) == len(values)
                and all(re.fullmatch(r"`?[\w.+-]+`?", v) for v in values)):  # a number or a `word` each
            rows.append((flags, [v.strip("`") for v in values]))
    return rows


def test_the_deliberate_default_differences_table_gives_our_defaults():
    """training.md's "complete list" of defaults that differ from Megatron-LM's states the value a bare
    command runs with (--train-iters 20 is what an unset --train-iters becomes)."""
    rows = _deliberate_default_rows()
    named = [flag for flags, _ in rows for flag in flags]
    assert {"--num-layers", "--seq-length", "--train-iters", "--lr", "--eval-iters", "--num-workers",
            "--ckpt-format", "--transformer-impl"} <= set(named), named
    config = parse_args(BASE, world_size=1)
    sections = [getattr(config, name) for name in ("model", "parallel", "training", "optim", "precision", "data",
                                                   "checkpoint", "logging", "moe", "fusion")]
    for flags, values in rows:
        for flag, value in zip(flags, values):
            field = flag[2:].replace("-", "_")
            got = next(getattr(s, field) for s in sections if hasattr(s, field))
            assert str(got) == value or (isinstance(got, float) and got == float(value)), (flag, value, got)
