"""The shell blocks of the docs, and how each command in them is checked (docs/contributing.md).

Every ```bash (or ```sh) block of README.md, docs/*.md and examples/**/README.md is collected. Its
logical lines (``\\`` continuations joined, comments dropped) are split into commands; ``NAME="..."``
assignments are remembered and ``$NAME`` expanded. Each command is then:

* ``python|torchrun pretrain_gpt.py|pretrain_bert.py ...``: validated by the script's own argument
  check (``MEGATRON_LITE_CHECK_ARGS=1``, world size = torchrun's ``--nproc-per-node`` x ``--nnodes``;
  no process group, data or model), or, when the command has placeholders (``...``, ``<flags>``,
  ``[--opt]``, an unknown ``$VAR``), each ``--flag`` name looked up in the script's parser;
* ``python tools/**.py ...``: parsed by the tool's own argparse parser (caught before ``main`` does
  any work), or its flag names looked up when there are placeholders;
* anything else (``bash``, ``pip``, ``sbatch``, benchmarks): only the file paths it names.

Every token naming a file of the repository (``tools/...``, ``examples/...``, ``docs/...``,
``benchmarks/...``, ``.ci/...``, ``pretrain_*.py``) must exist. A block preceded by
``<!-- doc-test: run -->`` is also executed with bash, in a scratch folder holding links to the
repository's scripts, with every training command shortened (:data:`RUN_OVERRIDES`); a block
preceded by ``<!-- doc-test: skip (reason) -->`` is not checked at all.

Outside the blocks, every ``--flag`` the text names must be a flag of ours (:func:`script_flags`) or
another program's (:data:`FOREIGN_FLAGS`), and one the text calls missing must not be ours; a numeric
default in a page's own ``| flag | default |`` table must be the parser's.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import glob
import inspect
import io
import os
import re
import runpy
import shlex
from dataclasses import dataclass, field

from megatron_lite.megatron_flags import REFUSED

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = ROOT  # the scripts' flags always come from here, even where a test points ROOT at other docs
SHELLS = ("bash", "sh")
RUN_MARK = "<!-- doc-test: run -->"
SKIP_MARK = re.compile(r"<!-- doc-test: skip \((.+)\) -->")
TRAINING_SCRIPTS = ("pretrain_gpt.py", "pretrain_bert.py")
RUN_OVERRIDES = ["--train-iters", "2", "--eval-iters", "0", "--lr-warmup-iters", "0", "--log-interval", "1"]
REPO_PATH = re.compile(r"^(\./)?((tools|examples|docs|benchmarks|megatron_lite|\.ci)/[\w./-]*\w|pretrain_\w+\.py)$")
TORCHRUN_SWITCHES = {"--standalone", "--no-python", "--run-path"}


@dataclass
class Block:
    path: str  # relative to the repository root
    line: int  # of the opening fence
    text: str
    mode: str  # "check", "run" or "skip"
    reason: str = ""

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


@dataclass
class Command:
    tokens: list[str]  # env assignments stripped, variables expanded
    env: dict[str, str] = field(default_factory=dict)

    @property
    def placeholders(self) -> bool:
        return any(t == "..." or t.startswith(("<", "[")) or t.endswith((">", "]")) or "$" in t for t in self.tokens)


def doc_files() -> list[str]:
    files = ["README.md"] + sorted(glob.glob("docs/*.md", root_dir=ROOT))
    return files + sorted(glob.glob("examples/**/README.md", root_dir=ROOT, recursive=True))


def blocks_of(path: str) -> list[Block]:
    lines = open(os.path.join(ROOT, path), encoding="utf-8").read().splitlines()
    out, i, previous = [], 0, ""
    while i < len(lines):
        fence = re.match(r"^\s*```(\w*)\s*$", lines[i])
        if not fence:
            previous = lines[i].strip() or previous
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```"))
        if fence.group(1) in SHELLS:
            skip = SKIP_MARK.fullmatch(previous)
            mode = "skip" if skip else "run" if previous == RUN_MARK else "check"
            out.append(Block(path, i + 1, "\n".join(lines[i + 1:end]), mode, skip.group(1) if skip else ""))
        previous, i = "", end + 1
    return out


def all_blocks() -> list[Block]:
    return [b for path in doc_files() for b in blocks_of(path)]


def logical_lines(text: str) -> list[str]:
    out, current = [], ""
    for line in text.splitlines():
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
        else:
            out.append(current + line)
            current = ""
    return [line for line in out + [current] if line.strip()]


def commands(block: Block) -> list[Command]:
    variables: dict[str, list[str]] = {}
    out = []
    for line in logical_lines(block.text):
        tokens = shlex.split(line, comments=True)
        for part in _split_on(tokens, {"&&", "||", ";", "|"}):
            env = {}
            while part and re.fullmatch(r"[A-Za-z_]\w*=.*", part[0]):
                name, value = part.pop(0).split("=", 1)
                env[name] = value
            if not part:  # NAME="..." on its own line: a shell variable used later in the block
                variables.update({k: shlex.split(v) for k, v in env.items()})
                continue
            if part[0] == "export":
                continue
            expanded = []
            for t in part:
                name = re.fullmatch(r"\$\{?(\w+)\}?", t)
                expanded += variables[name.group(1)] if name and name.group(1) in variables else [t]
            out.append(Command(expanded, env))
    return out


def _split_on(tokens: list[str], separators: set[str]) -> list[list[str]]:
    parts, current = [], []
    for t in tokens:
        if t in separators:
            parts.append(current)
            current = []
        else:
            current.append(t)
    return [p for p in parts + [current] if p]


def script_and_args(cmd: Command) -> tuple[str | None, list[str], int]:
    """(the Python script a command runs, its arguments, the world size) or (None, [], 1)."""
    t = cmd.tokens
    if t[0] in ("python", "python3") and len(t) > 1 and t[1].endswith(".py"):
        return t[1], t[2:], int(cmd.env.get("WORLD_SIZE", 1))
    if t[0] == "torchrun":
        world, nnodes, i = 1, 1, 1
        while i < len(t) and not t[i].endswith(".py"):
            flag, _, inline = t[i].partition("=")
            if flag in TORCHRUN_SWITCHES:
                i += 1
                continue
            value = inline or (t[i + 1] if i + 1 < len(t) else "")
            if flag in ("--nproc-per-node", "--nproc_per_node"):
                world = int(value)
            elif flag == "--nnodes":
                nnodes = int(value.split(":")[-1])
            i += 1 if inline else 2
        if i < len(t):
            return t[i], t[i + 1:], world * nnodes
    return None, [], 1


def missing_paths(cmd: Command) -> list[str]:
    """The repository files a command names that do not exist."""
    names = [v.strip("[]") for t in cmd.tokens for v in t.split("=", 1)[-1:]] + [t.strip("[]") for t in cmd.tokens]
    return sorted({n for n in names if REPO_PATH.match(n) and not os.path.exists(os.path.join(ROOT, n))})


def flag_names(args: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in args if a.startswith("--")]


class _Parsed(Exception):
    def __init__(self, parser):
        self.parser = parser


@contextlib.contextmanager
def _capture_parser():
    original = argparse.ArgumentParser.parse_args

    def capture(self, args=None, namespace=None):
        raise _Parsed(self)

    argparse.ArgumentParser.parse_args = capture
    try:
        yield original
    finally:
        argparse.ArgumentParser.parse_args = original


WRAPPERS = ("tools/run_lm_eval.py",)  # lm-eval's own command line (subcommands, its legacy form)


@functools.cache
def tool_parser(script: str) -> argparse.ArgumentParser | None:
    """The argparse parser a tool's ``main`` builds (caught at its parse_args: nothing else runs), or
    None for a wrapper handing its arguments to another program's command line (WRAPPERS) or a tool
    whose ``main`` takes no arguments: only its paths are checked."""
    if script in WRAPPERS:
        return None
    main = runpy.run_path(os.path.join(REPO, script), run_name="doc_check")["main"]
    if not inspect.signature(main).parameters:
        return None
    with _capture_parser():
        try:
            main([])
        except _Parsed as parsed:
            return parsed.parser
    raise AssertionError(f"{script}: main() never parsed its arguments")


@functools.cache
def training_parser(script: str) -> argparse.ArgumentParser:
    from megatron_lite.arguments import build_parser

    extra = None
    if script.endswith("pretrain_bert.py"):
        import pretrain_bert

        extra = {"bert": pretrain_bert.BertConfig}
    return build_parser(extra_sections=extra)


def check_flags(script: str, args: list[str], world: int, placeholders: bool) -> str:
    """'' if the command's flags are valid; else what is wrong. Returns quickly: no model is built."""
    name = os.path.basename(script)
    parser = training_parser(script) if name in TRAINING_SCRIPTS else tool_parser(script)
    if parser is None:
        return ""
    unknown = [f for f in flag_names(args) if f not in parser._option_string_actions]  # abbreviations too
    if unknown or placeholders:
        return f"{script}: unknown flags {unknown}" if unknown else ""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            if name in TRAINING_SCRIPTS:
                _check_training_args(name, args, world)
            else:
                parser.parse_args(args)
        except SystemExit as exc:
            if exc.code:
                last = (err.getvalue().strip().splitlines() or [""])[-1]
                return f"{script} (world size {world}): exit {exc.code}: {last}"
    return ""


def _check_training_args(name: str, args: list[str], world: int) -> None:
    """The script's own ``MEGATRON_LITE_CHECK_ARGS=1`` path: parse and validate, exit 0 or 2."""
    import importlib

    from megatron_lite.arguments import CHECK_ARGS_ENV

    saved = {k: os.environ.get(k) for k in (CHECK_ARGS_ENV, "WORLD_SIZE")}
    os.environ.update({CHECK_ARGS_ENV: "1", "WORLD_SIZE": str(world)})
    try:
        importlib.import_module(name[:-3]).main(args)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def runnable_text(block: Block) -> str:
    """The block as executed: every training command shortened with :data:`RUN_OVERRIDES`."""
    lines = []
    for line in logical_lines(block.text):
        code, _, _ = line.partition(" #")
        if any(s in code for s in TRAINING_SCRIPTS):
            line = code.rstrip() + " " + " ".join(RUN_OVERRIDES)
        lines.append(line)
    return "\n".join(lines)


# Flags the prose names that belong to other programs (torchrun, SLURM, pip, TensorBoard, Nsight,
# lm-eval), or to Megatron-LM and are named as missing here: each must stay unknown to our scripts.
FOREIGN_FLAGS = {
    "--nnodes", "--rdzv-backend", "--rdzv-endpoint",  # torchrun
    "--signal", "--ntasks-per-node", "--cpus-per-task",  # sbatch / srun / scancel
    "--no-build-isolation", "--logdir", "--capture-range", "--model_args",  # pip, tensorboard, nsys, lm-eval
    "--num-tokentypes", "--sft-tokenizer-prompt-format",  # Megatron-LM only
    "--apply_chat_template", "--fewshot_as_multiturn", "--system_instruction", "--cache_requests",  # lm-eval
    "--batch_size", "--max_batch_size",  # lm-eval
}
PROSE_FLAG = re.compile(r"(?<![\w-])--[a-z][\w-]*\w(?![\w*/-])")
ADD_ARGUMENT = re.compile(r"add_argument\(\s*(?:[\"']-\w[\"'],\s*)?[\"'](--[a-z][\w-]*)[\"']")
NOT_A_FLAG = re.compile(r"`(--[a-z][\w-]*)` is not a flag|[Nn]o `(--[a-z][\w-]*)` flag")


def prose(path: str) -> str:
    """A Markdown file without its fenced blocks (those are checked as commands)."""
    return re.sub(r"```.*?```", "", open(os.path.join(ROOT, path), encoding="utf-8").read(), flags=re.S)


@functools.cache
def script_flags() -> frozenset[str]:
    """Every flag of the training scripts and the tools' parsers, and every flag an ``add_argument`` call
    of tools/, benchmarks/ or the package names (benchmarks, the converter's groups)."""
    names = set(training_parser("pretrain_gpt.py")._option_string_actions)
    names |= set(training_parser("pretrain_bert.py")._option_string_actions)
    for pattern in ("tools/**/*.py", "benchmarks/**/*.py", "megatron_lite/**/*.py"):
        for file in glob.glob(pattern, root_dir=REPO, recursive=True):
            text = open(os.path.join(REPO, file), encoding="utf-8").read()
            names |= set(ADD_ARGUMENT.findall(text))
            if file.startswith("tools/") and re.search(r"^def main\(", text, flags=re.M):
                names |= _tool_flags(file)
    return frozenset(names)


def _tool_flags(script: str) -> set[str]:
    """The flags of a tool's parser (those added in a loop too), or none for a tool parsing by hand."""
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        try:
            parser = tool_parser(script)
        except (AssertionError, SystemExit, ImportError):
            return set()
    return set(parser._option_string_actions) if parser else set()


def prose_flag_problems(path: str) -> list[str]:
    """Flags the prose names that no script has, and flags it calls missing that a script has."""
    text = prose(path)
    known = script_flags()
    foreign = FOREIGN_FLAGS | set(REFUSED)  # Megatron-LM's flags we refuse (megatron_lite/megatron_flags.py)
    problems = [f"{f} is no flag of ours (nor in FOREIGN_FLAGS)" for f in sorted(set(PROSE_FLAG.findall(text)))
                if f not in known and f not in foreign]
    problems += [f"{f} is a flag of ours but FOREIGN_FLAGS lists it" for f in sorted(FOREIGN_FLAGS & known)]
    said_missing = {a or b for a, b in NOT_A_FLAG.findall(text)}
    problems += [f"the text says {f} is not a flag, but it is" for f in sorted(said_missing & known)]
    return problems


def _number(text: str) -> float | None:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def table_default_problems(path: str) -> list[str]:
    """Rows of a ``| flag | default | ...`` table (outside docs/flags.md) whose numeric default is not
    the training scripts' default. A row may name several flags with their defaults comma-separated."""
    actions = dict(training_parser("pretrain_bert.py")._option_string_actions)
    problems, column = [], None
    for line in prose(path).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|"):
            column = None
        elif "flag" in cells[0] and any("default" in c for c in cells):
            column = next(i for i, c in enumerate(cells) if "default" in c)
        elif column is not None and column < len(cells) and not set(cells[0]) <= set("-: "):
            flags = re.findall(r"`(--[a-z][\w-]*)", cells[0])
            values = [v.strip() for v in cells[column].split(",")]
            for flag, value in zip(flags, values) if len(flags) == len(values) else ():
                default = getattr(actions.get(flag), "default", None)
                default = default[0] if isinstance(default, list) and len(default) == 1 else default
                if flag in actions and _number(value) is not None and _number(default) != _number(value):
                    problems.append(f"{flag}: the table says {value}, the default is {default!r}")
    return problems
