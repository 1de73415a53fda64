"""Docs that run: every shell block of README.md, docs/*.md and examples/**/README.md is exercised
(tests/doc_blocks.py; the convention is in docs/contributing.md). Training and tool commands have
their flags validated by their own argument parsers, file paths must exist, blocks marked
``<!-- doc-test: run -->`` are executed at tiny sizes, relative Markdown links resolve, and every
flag the prose names is one of ours (or listed as another program's) and none it calls missing is;
the numeric defaults of the pages' flag tables are the code's. The
count of blocks and commands is printed by test_summary (``pytest -s``) and shows in the test ids."""

import os
import re
import subprocess
import sys

import pytest

from tests.doc_blocks import (
    ROOT,
    RUN_MARK,
    all_blocks,
    blocks_of,
    check_flags,
    commands,
    doc_files,
    missing_paths,
    prose_flag_problems,
    runnable_text,
    script_and_args,
    table_default_problems,
)

BLOCKS = all_blocks()
CHECKED = [b for b in BLOCKS if b.mode != "skip"]
RUN = [b for b in BLOCKS if b.mode == "run"]
LINKED_FOLDERS = ("tools", "examples", "megatron_lite", "pretrain_gpt.py", "pretrain_bert.py", "tests")


def test_summary(capsys):
    cmds = [c for b in CHECKED for c in commands(b)]
    scripts = [c for c in cmds if _validated(script_and_args(c)[0])]
    with capsys.disabled():
        print(f"\n[docs] {len(BLOCKS)} shell blocks in {len(doc_files())} files: {len(CHECKED)} checked "
              f"({len(RUN)} also executed), {len(BLOCKS) - len(CHECKED)} skipped with a reason; "
              f"{len(cmds)} commands, {len(scripts)} of them Python scripts whose flags are validated")
    assert len(CHECKED) >= 10 and len(RUN) >= 2


def _validated(script) -> bool:
    """Scripts whose flags are checked: the training scripts and tools/."""
    return bool(script) and (script.startswith("tools/") or os.path.basename(script).startswith("pretrain_"))


@pytest.mark.parametrize("block", CHECKED, ids=[b.id for b in CHECKED])
def test_block_commands_are_valid(block):
    problems = []
    for cmd in commands(block):
        problems += [f"missing file {p}" for p in missing_paths(cmd)]
        script, args, world = script_and_args(cmd)
        if _validated(script):
            problem = check_flags(script, args, world, cmd.placeholders)
            if problem:
                problems.append(problem)
    assert not problems, f"{block.id}: " + "; ".join(problems)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """One folder per doc file in which its executed blocks run in order (later blocks use the data
    and checkpoints earlier ones wrote), with links to the repository's scripts."""
    folders = {}

    def folder(path):
        if path not in folders:
            d = tmp_path_factory.mktemp(re.sub(r"\W", "_", path))
            for name in LINKED_FOLDERS:
                os.symlink(os.path.join(ROOT, name), d / name)
            folders[path] = d
        return folders[path]

    return folder


@pytest.mark.parametrize("block", RUN, ids=[b.id for b in RUN])
def test_marked_block_runs(block, scratch):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    python_dir = os.path.dirname(sys.executable)
    env["PATH"] = python_dir + os.pathsep + env.get("PATH", "")  # "python" is this interpreter
    done = subprocess.run(["bash", "-e", "-c", runnable_text(block)], cwd=scratch(block.path), env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{block.id} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def test_the_convention_catches_a_renamed_flag_and_a_moved_file(tmp_path):
    """A block with a wrong flag, a bad value or a missing file fails its check (else the test above could not fail)."""
    from tests.doc_blocks import Block

    bad = [
        "python pretrain_gpt.py --mock-data --vocab-size 64 --num-layerz 2",
        "python pretrain_gpt.py --mock-data --vocab-size 64 --tensor-model-parallel-size 3",
        "torchrun --nproc-per-node 4 pretrain_gpt.py --mock-data --vocab-size 64 --tensor-model-parallel-size 8",
        "python pretrain_gpt.py ... --no-such-flag",
        "python tools/preprocess_data.py --input a.jsonl --output-prefix a --tokenizer-typ GPT2BPETokenizer",
        "bash examples/no_such_script.sh",
    ]
    for text in bad:
        block = Block("x.md", 1, text, "check")
        with pytest.raises(AssertionError):
            test_block_commands_are_valid(block)
    good = Block("x.md", 1, "torchrun --nproc-per-node 2 pretrain_gpt.py --mock-data --vocab-size 64 "
                            "--tensor-model-parallel-size 2", "check")
    test_block_commands_are_valid(good)


def test_markers_are_read(tmp_path, monkeypatch):
    import tests.doc_blocks as doc_blocks

    (tmp_path / "d.md").write_text(f"{RUN_MARK}\n```bash\necho a\n```\n<!-- doc-test: skip (needs a cluster) -->\n"
                                   "```bash\nsbatch x\n```\n```bash\necho c\n```\n```text\nnot shell\n```\n")
    monkeypatch.setattr(doc_blocks, "ROOT", str(tmp_path))
    found = blocks_of("d.md")
    assert [(b.mode, b.reason) for b in found] == [("run", ""), ("skip", "needs a cluster"), ("check", "")]


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _slugs(path: str) -> set[str]:
    """GitHub's anchors of a Markdown file's headings (lower case, punctuation dropped, spaces -> -)."""
    text = re.sub(r"```.*?```", "", open(path, encoding="utf-8").read(), flags=re.S)
    titles = re.findall(r"^#{1,6} (.+)$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", t.strip().lower()).replace(" ", "-") for t in titles}


@pytest.mark.parametrize("path", doc_files())
def test_relative_links_resolve(path):
    """Every relative link names an existing file, and its #anchor a heading of that file."""
    text = open(os.path.join(ROOT, path), encoding="utf-8").read()
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    broken = []
    for target in LINK.findall(text):
        if "://" in target or target.startswith("mailto:"):
            continue
        file, _, anchor = target.partition("#")
        full = os.path.join(ROOT, os.path.dirname(path), file) if file else os.path.join(ROOT, path)
        if not os.path.exists(full) or (anchor and full.endswith(".md") and anchor not in _slugs(full)):
            broken.append(target)
    assert not broken, f"{path}: broken links {broken}"


@pytest.mark.parametrize("path", doc_files())
def test_flags_named_in_prose_exist(path):
    """A ``--flag`` in the text (outside the command blocks) is a flag of the training scripts, a
    tool or a benchmark, or another program's (FOREIGN_FLAGS); a flag the text says is missing is not ours."""
    problems = prose_flag_problems(path)
    assert not problems, f"{path}: " + "; ".join(problems)


def test_the_prose_check_catches_a_renamed_flag_and_a_stale_absence(tmp_path, monkeypatch):
    import tests.doc_blocks as doc_blocks

    (tmp_path / "a.md").write_text("Use `--num-layerz 2`.\n```bash\npython x.py --in-a-block\n```\n")
    (tmp_path / "b.md").write_text("No fused kernels (`--no-rope-fusion` is not a flag).\n")
    (tmp_path / "c.md").write_text("There is no `--lr` flag; torchrun's `--nnodes`, `--lora-*`, `--no-...` forms.\n")
    (tmp_path / "d.md").write_text("`--num-layers`, `--max-shard-size` (convert), `--fp32-peak-tflops` (benchmark).\n")
    monkeypatch.setattr(doc_blocks, "ROOT", str(tmp_path))
    assert prose_flag_problems("a.md") == ["--num-layerz is no flag of ours (nor in FOREIGN_FLAGS)"]
    assert prose_flag_problems("b.md") == ["the text says --no-rope-fusion is not a flag, but it is"]
    assert prose_flag_problems("c.md") == ["the text says --lr is not a flag, but it is"]
    assert prose_flag_problems("d.md") == []


@pytest.mark.parametrize("path", doc_files())
def test_flag_tables_state_the_defaults(path):
    """A page's own ``| flag | default |`` table (BERT, DeepSeek-V3, MoE, LoRA) gives the parser's defaults."""
    problems = table_default_problems(path)
    assert not problems, f"{path}: " + "; ".join(problems)


def test_the_table_check_catches_a_changed_default(tmp_path, monkeypatch):
    import tests.doc_blocks as doc_blocks

    (tmp_path / "t.md").write_text("| flag | default | meaning |\n|---|---|---|\n| `--kv-lora-rank` | 64 | x |\n"
                                   "| `--beta-fast`, `--beta-slow` | 32, 2 | x |\n| `--mask-prob` | 0.15 | x |\n"
                                   "| `--moe-aux-loss-coeff` | 0.0 | x |\n| `--q-lora-rank` | None | x |\n")
    monkeypatch.setattr(doc_blocks, "ROOT", str(tmp_path))
    assert table_default_problems("t.md") == ["--kv-lora-rank: the table says 64, the default is 32",
                                              "--beta-slow: the table says 2, the default is 1.0"]
