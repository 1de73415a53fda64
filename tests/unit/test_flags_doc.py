"""docs/flags.md is generated from the config dataclasses by tools/make_flags_doc.py and is up to date:
a flag added, renamed or re-documented without regenerating it fails here."""

import runpy
import shutil

import pytest

from megatron_lite.arguments import build_parser
from tests.doc_blocks import ROOT

TOOL = runpy.run_path(f"{ROOT}/tools/make_flags_doc.py", run_name="flags_doc")


def test_docs_flags_md_is_up_to_date(capsys):
    code = TOOL["main"](["--check"])
    assert code == 0, capsys.readouterr().err + " (regenerate: python tools/make_flags_doc.py)"


def test_every_training_flag_is_in_the_reference():
    text = open(f"{ROOT}/docs/flags.md", encoding="utf-8").read()
    flags = [s for s in build_parser()._option_string_actions if s.startswith("--") and s != "--help"]
    assert len(flags) > 150
    missing = [f for f in flags if f"`{f}`" not in text]
    assert not missing, missing
    assert "`--mask-prob`" in text  # pretrain_bert.py's own section


@pytest.mark.parametrize("edit", [lambda t: t.replace("Number of transformer layers.", "Layers."),
                                  lambda t: t.replace("| `--seq-length` |", "| `--seq-len` |")])
def test_check_fails_on_a_stale_reference(tmp_path, capsys, edit):
    stale = tmp_path / "flags.md"
    shutil.copy(f"{ROOT}/docs/flags.md", stale)
    stale.write_text(edit(stale.read_text()))
    assert TOOL["main"](["--check", "--output", str(stale)]) == 1
    assert "out of date" in capsys.readouterr().err
    assert TOOL["main"](["--output", str(stale)]) == 0
    assert TOOL["main"](["--check", "--output", str(stale)]) == 0


def test_angle_brackets_in_help_text_survive_markdown():
    """'(default: <save>/wandb)' is written &lt;save>: as raw HTML a Markdown viewer dropped '<save>'."""
    text = open(f"{ROOT}/docs/flags.md", encoding="utf-8").read()
    rows = [line for line in text.splitlines() if line.startswith("| `--")]
    assert any("&lt;save>/wandb" in row for row in rows)
    assert not [row for row in rows if "<" in row.split(" | ", 3)[-1]]  # no raw '<' in a help cell


def test_no_help_text_is_cut_inside_parentheses():
    """The accepted Megatron flags' list takes each help text after its "Accepted for Megatron ...:" lead;
    --use-megatron-fsdp's lead holds "(--use-custom-fsdp: its older name)", whose ": " cut it to
    "its older name): ...". Every line and table cell keeps its parentheses balanced, and the list
    names both spellings."""
    text = TOOL["render"]()
    pieces = [cell for line in text.splitlines() if line.startswith("| `--") for cell in line.split(" | ")]
    pieces += [line for line in text.splitlines() if line.startswith("- `--")]
    unbalanced = [p for p in pieces if p.count("(") != p.count(")")]
    assert not unbalanced, unbalanced
    assert "- `--use-megatron-fsdp` / `--use-custom-fsdp`: the sharding strategies" in text
    assert TOOL["_after_mark"]("Accepted for X (a: b): c (d: e).") == "c (d: e)."
