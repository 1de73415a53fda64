#!/usr/bin/env python3
"""Write docs/flags.md: every flag of pretrain_gpt.py and pretrain_bert.py, generated from the config
dataclasses (through the same argparse parser the scripts build), so the reference cannot drift.

    python tools/make_flags_doc.py            # rewrite docs/flags.md
    python tools/make_flags_doc.py --check    # exit 1 (and say so) when docs/flags.md is out of date

Each section is one config dataclass; each row is a flag, what it takes (its choices, or N / X /
VALUE for an integer / a number / a string), its default and its help text (the string literal
under the field).
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_lite.arguments import build_parser  # noqa: E402
from megatron_lite.errors import OneLineParser, run_tool  # noqa: E402
from megatron_lite.files import replaced_whole  # noqa: E402
from megatron_lite.megatron_flags import ENTRIES, REFUSED_VALUES  # noqa: E402

OUTPUT = os.path.join(ROOT, "docs", "flags.md")
HEADER = """# Flags reference

You want to know what a flag of `pretrain_gpt.py` / `pretrain_bert.py` does, what it takes and its
default. This page is generated from the config dataclasses by `python tools/make_flags_doc.py`
(a test fails when it is out of date); `python pretrain_gpt.py --help` prints the same. Flags keep
Megatron-LM's names and defaults. A switch that is on by default also has a `--no-` form.
Where each group is explained: [training](training.md), [parallelism](parallelism.md),
[mixture of experts](mixture-of-experts.md), [precision and FP8](precision-and-fp8.md),
[checkpoints](checkpoints.md), [data and tokenizers](data-and-tokenizers.md),
[fine-tuning](fine-tuning.md), [performance](performance.md), [BERT](bert.md).
"""
SECTION_NOTES = {"bert": "`pretrain_bert.py` only."}
ACCEPTED_MARK = "Accepted for Megatron"  # "... scripts:", "...-FSDP scripts:"
MEGATRON_HEADER = """
## Megatron-LM flags megatron_lite does not take

A Megatron-LM launch script (its `examples/` recipes: GPT-3, Llama, Mixtral, DeepSeek, BERT) can be
pasted as it is: every flag it passes is either one of the flags above, with Megatron-LM's meaning,
or is refused before any work with one line and exit code 2 that says it is a Megatron-LM flag, why
it is absent here and what to do instead, e.g.

    pretrain_gpt.py: error: --tp-comm-overlap is a Megatron-LM flag that megatron_lite does not support: ...; drop it

Fix that flag and run again; the line also names the script's other unrecognised flags. A flag that
is neither ours nor Megatron-LM's (a typo) gets argparse's message and, when one is close, the flag
of ours that was probably meant ("did you mean --num-layers?"). To check a whole script
without running it: `MEGATRON_LITE_CHECK_ARGS=1 WORLD_SIZE=<ranks> python pretrain_gpt.py <its flags>`.
The flags covered are those of the Megatron-LM version named in `tests/fixtures/megatron_flags.txt`
(its whole flag list, checked by a test); a flag Megatron-LM added after it may still get argparse's
plain message.

Accepted because they name what megatron_lite always does (they change nothing):

"""


def _cell(text: str) -> str:
    """A table cell: argparse's %% unescaped, | escaped, < as an entity (Markdown would take ``<save>``
    for an HTML tag and show nothing)."""
    return text.replace("%%", "%").replace("|", "\\|").replace("\n", " ").replace("<", "&lt;")


def _takes(action: argparse.Action) -> str:
    if action.nargs == 0:
        return ""
    if action.choices:
        one = "{" + ",".join(map(str, action.choices)) + "}"
    elif isinstance(action.metavar, tuple):
        return " ".join(action.metavar)
    else:
        one = action.metavar or "VALUE"
    return f"{one} [...]" if action.nargs in ("+", "*") else one


def _help_and_default(action: argparse.Action) -> tuple[str, str]:
    text = _cell(action.help or "")
    marker = " (default: "
    if text.endswith(")") and marker in text:
        text, default = text.rsplit(marker, 1)
        return text, default[:-1]
    return text, ""


def _after_mark(text: str) -> str:
    """The help text after its "Accepted for Megatron ... :" lead, split at the first ": " outside
    parentheses (a lead such as "... scripts (--use-custom-fsdp: its older name):" holds one inside)."""
    depth = 0
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0 and text.startswith(": ", i):
            return text[i + 2:]
    raise ValueError(f"an accepted flag's help text has no ': ' after its lead: {text!r}")


def render() -> str:
    import pretrain_bert

    parser = build_parser(extra_sections={"bert": pretrain_bert.BertConfig})
    out = [HEADER]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.option_strings and a.dest != "help"]
        if not actions:
            continue
        out.append(f"\n## {group.title}\n")
        if group.title in SECTION_NOTES:
            out.append(SECTION_NOTES[group.title] + "\n")
        out.append("| flag | takes | default | what it does |\n|---|---|---|---|")
        for action in actions:
            flags = " / ".join(f"`{s}`" for s in action.option_strings)
            takes = _takes(action)
            help_text, default = _help_and_default(action)
            out.append(f"| {flags} | {f'`{takes}`' if takes else ''} | {_cell(default)} | {help_text} |")
    out.append(_megatron_section(parser))
    return "\n".join(out) + "\n"


def _megatron_section(parser) -> str:
    """The Megatron-LM flags accepted as equivalents (their help says so) and those refused (the
    table in megatron_lite/megatron_flags.py, one row per shared reason)."""
    accepted = [f"- {' / '.join(f'`{s}`' for s in a.option_strings)}: {_after_mark(_cell(a.help))}"
                for a in parser._actions if (a.help or "").startswith(ACCEPTED_MARK)]
    rows = ["| Megatron-LM flags | why they are absent | instead |", "|---|---|---|"]
    for flags, why, fix in ENTRIES:
        rows.append(f"| {' '.join(f'`{f}`' for f in flags.split())} | {_cell(why)} | {_cell(fix)} |")
    values = ["| Megatron-LM value | why it is absent | instead |", "|---|---|---|"]
    for flag, refused in REFUSED_VALUES.items():
        values += [f"| `{flag} {value}` | {_cell(why)} | {_cell(fix)} |" for value, (why, fix) in refused.items()]
    return (MEGATRON_HEADER + "\n".join(accepted) + "\n\nRefused (megatron_lite/megatron_flags.py):\n\n"
            + "\n".join(rows) + "\n\nValues of our flags that Megatron-LM takes and megatron_lite refuses the "
            "same way:\n\n" + "\n".join(values))


def main(argv=None) -> int:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="Only check that docs/flags.md is up to date.")
    parser.add_argument("--output", default=OUTPUT, help="Where to write (default: docs/flags.md).")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = open(args.output, encoding="utf-8").read() if os.path.exists(args.output) else ""
        if current != text:
            print(f"{os.path.relpath(args.output, ROOT)} is out of date: run python tools/make_flags_doc.py",
                  file=sys.stderr)
            return 1
        return 0
    with replaced_whole(args.output) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {os.path.relpath(args.output, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
