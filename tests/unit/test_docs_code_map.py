"""The docs' map of the code stays true when files are split and functions move.

Every ``path/to/file.py`` named in backticks in README.md, docs/*.md and examples/**/README.md exists
(a path with a folder: from the repository root, from ``megatron_lite/`` or from the page's folder; a
bare ``name.py``: somewhere in the repository). Every function, class or attribute the README's code
map tables ("Where things are", "Where to change what") name in backticks is defined in a file its
row names (a named folder stands for its files; ``Class.member`` may also be a class defined
elsewhere in the package). Every dotted ``megatron_lite.module.name`` in the pages' backticks and every
``from megatron_lite.module import name`` line of their code blocks names a module that exists and a
name it defines or imports. Definitions are read with ``ast``: nothing is imported, no torch.

The map is complete too: every subpackage of ``megatron_lite/`` (a folder with an ``__init__.py``, at any
depth) is named by a row of "Where things are" (the folder itself, or a file directly in it: a folder
above it does not count, nor does every module need a row), and every script under ``tools/`` is named
by its path in README.md or a docs page the README links to.
"""

from __future__ import annotations

import ast
import functools
import glob
import os
import re

import pytest

from tests.doc_blocks import ROOT, doc_files

PACKAGE = "megatron_lite"
CODE_MAP_HEADINGS = ("## Where things are", "## Where to change what")
NOT_CODE = {"torch_dist"}  # backticked words of the code map that are no Python name (a --ckpt-format value)
SPAN = re.compile(r"`([^`\n]+(?:\n[^`\n]+)?)`")  # inline code, which may wrap onto a second line
LINK_TARGET = re.compile(r"\]\(([^)\s#]+\.py)\)")
PY_WORD = re.compile(r"[\w./*-]*[\w*]\.py\b")
DOTTED = re.compile(rf"\b{PACKAGE}(?:\.\w+)+")
FROM_IMPORT = re.compile(rf"^\s*from ({PACKAGE}[\w.]*) import ([\w, ]+)$", flags=re.M)
NAME = re.compile(r"(self\.)?([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?)")


def _prose(root: str, path: str) -> str:
    text = open(os.path.join(root, path), encoding="utf-8").read()
    return re.sub(r"^\s*```.*?^\s*```", "", text, flags=re.S | re.M)


@functools.cache
def _basenames(root: str) -> frozenset[str]:
    return frozenset(os.path.basename(p) for p in glob.glob("**/*.py", root_dir=root, recursive=True))


def _matches(base: str, word: str) -> list[str]:
    """The files ``word`` (a path, or a ``*`` pattern) names under ``base``."""
    full = os.path.join(base, word)
    if "*" in word:
        return sorted(glob.glob(full))
    return [full] if os.path.exists(full) else []


def missing_files(path: str, root: str = ROOT) -> list[str]:
    """The ``*.py`` paths in the backticks of a page that name no file."""
    bases = [root, os.path.join(root, PACKAGE), os.path.join(root, os.path.dirname(path))]
    missing = []
    for span in SPAN.findall(_prose(root, path)):
        for word in PY_WORD.findall(span):
            word = word.removeprefix("./")
            if "/" in word:
                found = any(_matches(b, word) for b in bases)
            else:
                found = "*" in word or word in _basenames(root) or any(_matches(b, word) for b in bases)
            if not found:
                missing.append(f"`{word}` names no file")
    return sorted(set(missing))


@functools.cache
def definitions(file: str) -> frozenset[str]:
    """Functions, classes, assigned names and ``self.`` attributes of a file, bare and as ``Class.member``."""
    tree = ast.parse(open(file, encoding="utf-8").read(), filename=file)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            for inner in ast.walk(node):
                member = _member(inner)
                if member:
                    names.update({member, f"{node.name}.{member}"})
    for node in tree.body:
        for target in _targets(node):
            if isinstance(target, ast.Name):
                names.add(target.id)
    return frozenset(names)


def _targets(node) -> list:
    if isinstance(node, ast.Assign):
        return node.targets
    return [node.target] if isinstance(node, ast.AnnAssign) else []


def _member(node) -> str | None:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name
    for target in _targets(node):
        if isinstance(target, ast.Name):
            return target.id
        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
            return target.attr
    return None


def _module_names(file: str) -> set[str]:
    tree = ast.parse(open(file, encoding="utf-8").read(), filename=file)
    imported = {a.asname or a.name.split(".")[0] for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))
                for a in node.names}
    return set(definitions(file)) | imported


def _module_file(parts: list[str], root: str) -> str | None:
    base = os.path.join(root, *parts)
    return next((f for f in (base + ".py", os.path.join(base, "__init__.py")) if os.path.isfile(f)), None)


def dotted_problems(path: str, root: str = ROOT) -> list[str]:
    """The ``megatron_lite.x.y`` names of a page's prose and its code blocks' imports that do not resolve."""
    refs = [(ref, []) for span in SPAN.findall(_prose(root, path)) for ref in DOTTED.findall(span)]
    text = open(os.path.join(root, path), encoding="utf-8").read()
    refs += [(mod, [n.strip() for n in names.split(",") if n.strip()]) for mod, names in FROM_IMPORT.findall(text)]
    problems = []
    for ref, names in refs:
        parts = ref.split(".")
        k = next((k for k in range(len(parts), 0, -1) if _module_file(parts[:k], root)), 0)
        if not k or (names and k < len(parts)):
            problems.append(f"`{ref}`: no such module")
            continue
        file, rest = _module_file(parts[:k], root), parts[k:]
        defined = _module_names(file)
        wanted = names or rest[:1] + ([".".join(rest[:2])] if len(rest) > 1 and rest[0] in definitions(file) and
                                      rest[0][:1].isupper() else [])
        problems += [f"`{ref}`: {os.path.relpath(file, root)} has no `{n}`" for n in wanted if n not in defined]
    return sorted(set(problems))


def code_map_rows(root: str = ROOT, headings: tuple[str, ...] = CODE_MAP_HEADINGS) -> list[list[str]]:
    """The rows (cells) of the README's code map tables, header and rule left out."""
    rows, inside = [], False
    for line in open(os.path.join(root, "README.md"), encoding="utf-8"):
        if line.startswith("#"):
            inside = line.strip() in headings
        elif inside and line.startswith("|"):
            rows.append([c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]])
    return [r for r in rows if not set("".join(r)) <= set("-: ") and r[1] not in ("where", "the code")]


def _row_files(cells: list[str], root: str, folders: set[str] | None = None) -> tuple[list[str], list[str]]:
    """The files a row names (folders: their files; bare names: beside an earlier one), and the unresolved.
    ``folders`` collects the folders the row names itself: each folder given, each given file's folder."""
    text = " | ".join(cells)
    bases, files, unresolved = [root, os.path.join(root, PACKAGE)], [], []
    folders = set() if folders is None else folders
    words = [w for span in SPAN.findall(text) for w in span.split()] + LINK_TARGET.findall(text)
    for word in (w.strip(",;()") for w in words):
        if word.endswith("/") and os.path.isdir(os.path.join(root, word)):
            bases.append(os.path.join(root, word))
            folders.add(os.path.normpath(os.path.join(root, word)))
            files += glob.glob(os.path.join(root, word, "**", "*.py"), recursive=True)
        elif PY_WORD.fullmatch(word):
            found = next((m for b in reversed(bases) for m in [_matches(b, word)] if m), None)
            if found is None:
                unresolved.append(word)
                continue
            files += found
            folders.update(os.path.normpath(os.path.dirname(f)) for f in found)
            bases.append(os.path.dirname(found[0]))
    return files, unresolved


@functools.cache
def _package_texts(root: str) -> dict[str, str]:
    return {f: open(f, encoding="utf-8").read() for f in glob.glob(os.path.join(root, PACKAGE, "**", "*.py"), recursive=True)}


def _class_files(owner: str, root: str) -> list[str]:
    """The package's files with a ``class owner`` line (text search: only those are then parsed)."""
    line = re.compile(rf"^\s*class {re.escape(owner)}\b", flags=re.M)
    return [f for f, text in _package_texts(root).items() if line.search(text)]


def code_map_problems(root: str = ROOT) -> list[str]:
    """Each code-map name that no file of its row defines, and each file of a row that does not exist."""
    problems = []
    for cells in code_map_rows(root):
        files, unresolved = _row_files(cells, root)
        problems += [f"row '{cells[0]}': `{w}` names no file" for w in unresolved]
        for span in SPAN.findall(" | ".join(cells[1:])):
            name = NAME.fullmatch(span)
            if not name or span in NOT_CODE or PY_WORD.fullmatch(span):
                continue
            name = name.group(2)
            if any(name in definitions(f) for f in files):  # parses only as far as needed
                continue
            owner_files = _class_files(name.split(".")[0], root) if "." in name else []
            if not any(name in definitions(f) for f in owner_files):
                where = ", ".join(sorted(os.path.relpath(f, root) for f in files)) or "no file"
                problems.append(f"row '{cells[0]}': `{name}` is not defined in {where}")
    return problems


def unmapped_subpackages(root: str = ROOT) -> list[str]:
    """The subpackages of the package that no row of "Where things are" names (itself or a file in it)."""
    named: set[str] = set()
    for cells in code_map_rows(root, headings=(CODE_MAP_HEADINGS[0],)):
        _row_files(cells, root, named)
    inits = glob.glob(os.path.join(root, PACKAGE, "*", "**", "__init__.py"), recursive=True)
    packages = sorted(os.path.normpath(os.path.dirname(f)) for f in inits)
    return [os.path.relpath(p, root) + "/" for p in packages if p not in named]


def linked_pages(root: str = ROOT) -> list[str]:
    """README.md and the docs pages it links to."""
    text = open(os.path.join(root, "README.md"), encoding="utf-8").read()
    links = re.findall(r"\]\((docs/[\w.-]+\.md)(?:#[^)]*)?\)", text)
    return ["README.md"] + sorted({m for m in links if os.path.isfile(os.path.join(root, m))})


def unnamed_tools(root: str = ROOT) -> list[str]:
    """The scripts under ``tools/`` whose path (``tools/x.py``) neither README.md nor a page it links to names."""
    text = "\n".join(open(os.path.join(root, page), encoding="utf-8").read() for page in linked_pages(root))
    tools = sorted(glob.glob("tools/**/*.py", root_dir=root, recursive=True))
    return [t for t in tools if not os.path.basename(t).startswith("_")
            and not re.search(rf"(?<![\w/.]){re.escape(t)}\b", text)]


def test_code_map_tables_are_parsed():
    rows = code_map_rows()
    assert len(rows) >= 25, f"the README's code map tables gave {len(rows)} rows: did a heading change?"
    assert all(len(r) == 3 for r in rows), [r for r in rows if len(r) != 3]


def test_code_map_names_live_where_the_readme_says():
    problems = code_map_problems()
    assert not problems, "README.md code map: " + "; ".join(problems)


@pytest.mark.parametrize("path", doc_files())
def test_named_python_files_exist(path):
    problems = missing_files(path)
    assert not problems, f"{path}: " + "; ".join(problems)


@pytest.mark.parametrize("path", doc_files())
def test_named_modules_and_imports_resolve(path):
    problems = dotted_problems(path)
    assert not problems, f"{path}: " + "; ".join(problems)


def test_the_checks_catch_a_moved_function_and_a_removed_file(tmp_path):
    pkg = tmp_path / PACKAGE / "training"
    pkg.mkdir(parents=True)
    (pkg / "loop.py").write_text("def pretrain():\n    pass\n")
    (pkg / "cfg.py").write_text("class Cfg:\n    def make(self):\n        pass\n")
    (pkg / "step.py").write_text("class Step:\n    def __init__(self):\n        self.gemm = None\n"
                                 "def train_step():\n    pass\n")
    (tmp_path / "README.md").write_text(
        "## Where things are\n\n| piece | where | what it does |\n|---|---|---|\n"
        "| loop | `megatron_lite/training/loop.py`, `step.py` | `pretrain`, `train_step`, `Step.gemm`, `gone`, `Cfg.make`, `Cfg.gone` |\n"
        "| old | `megatron_lite/training/old.py` | `x` |\n\n## Elsewhere\n\n| a | b | c |\n|---|---|---|\n"
        "| not | the | `map` |\n\nSee `training/step.py`, `loop.py`, `megatron_lite/data/idx.py`, `nowhere.py`.\n"
        "`megatron_lite.training.step.train_step`, `megatron_lite.training.loop.train_step`, "
        "`megatron_lite.training.stepp`, `megatron_lite.training.step.Step.gemm`, `megatron_lite.training.step.Step.x`."
        "\n```python\nfrom megatron_lite.training.loop import pretrain, evaluate\n```\n")
    assert code_map_problems(str(tmp_path)) == [
        "row 'loop': `gone` is not defined in megatron_lite/training/loop.py, megatron_lite/training/step.py",
        "row 'loop': `Cfg.gone` is not defined in megatron_lite/training/loop.py, megatron_lite/training/step.py",
        "row 'old': `megatron_lite/training/old.py` names no file",
        "row 'old': `x` is not defined in no file"]
    assert missing_files("README.md", str(tmp_path)) == ["`megatron_lite/data/idx.py` names no file",
                                                         "`megatron_lite/training/old.py` names no file",
                                                         "`nowhere.py` names no file"]
    assert dotted_problems("README.md", str(tmp_path)) == [
        "`megatron_lite.training.loop.train_step`: megatron_lite/training/loop.py has no `train_step`",
        "`megatron_lite.training.loop`: megatron_lite/training/loop.py has no `evaluate`",
        "`megatron_lite.training.step.Step.x`: megatron_lite/training/step.py has no `Step.x`",
        "`megatron_lite.training.stepp`: no such module"]


def test_every_subpackage_has_a_row_in_the_code_map():
    missing = unmapped_subpackages()
    assert not missing, ("README.md's \"Where things are\" names no file of " + ", ".join(missing) +
                         ": add a row (piece | where | what it does), naming the folder and its key functions")


def test_every_tool_is_named_in_the_docs():
    missing = unnamed_tools()
    assert not missing, ("no page of the docs (README.md and the docs/*.md it links to) names " + ", ".join(missing) +
                         ": say what it does where a user looks for it, by its path")


def test_the_completeness_checks_catch_an_unmapped_subpackage_and_an_unnamed_tool(tmp_path):
    for folder in ("a", "b", "b/sub", "c", "c/deep", "not_a_package"):
        (tmp_path / PACKAGE / folder).mkdir(parents=True)
    for init in ("a", "b", "b/sub", "c", "c/deep"):
        (tmp_path / PACKAGE / init / "__init__.py").write_text("")
    (tmp_path / PACKAGE / "c" / "deep" / "x.py").write_text("def f():\n    pass\n")
    (tmp_path / "tools" / "sub").mkdir(parents=True)
    (tmp_path / "docs").mkdir()
    for tool in ("named.py", "linked.py", "orphan.py", "in_unlinked_page.py", "_helper.py", "sub/nested.py"):
        (tmp_path / "tools" / tool).write_text("")
    (tmp_path / "docs" / "page.md").write_text("Run `python tools/linked.py` (not `othertools/orphan.py`).\n")
    (tmp_path / "docs" / "unlinked.md").write_text("`tools/in_unlinked_page.py`\n")
    (tmp_path / "README.md").write_text(
        "## Where things are\n\n| piece | where | what it does |\n|---|---|---|\n"
        "| a | `megatron_lite/a/` | all of a |\n| b | `megatron_lite/b/` | b, and b/sub through its parent only |\n"
        "| deep | `megatron_lite/c/deep/x.py` | `f` |\n\n## Where to change what\n\n| a | b | c |\n|---|---|---|\n"
        "| not the map | `megatron_lite/c/` | `x` |\n\n`tools/named.py`, `tools/sub/nested.py`, [page](docs/page.md).\n")
    assert unmapped_subpackages(str(tmp_path)) == ["megatron_lite/b/sub/", "megatron_lite/c/"]
    assert unnamed_tools(str(tmp_path)) == ["tools/in_unlinked_page.py", "tools/orphan.py"]
