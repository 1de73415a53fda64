"""Every benchmark's command line keeps the project's promise for bad input: one line on stderr naming
the flag, exit code 2 (not argparse's usage block), before any work starts."""

import glob
import importlib
import os
import sys

import pytest

from tests.cli_errors import refused_line

BENCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")
SCRIPTS = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(BENCH_DIR, "bench_*.py")))
SCRIPTS.append("cuda_checks")


def run_main(monkeypatch, name, *argv):
    module = importlib.import_module(f"benchmarks.{name}")
    monkeypatch.setattr(sys, "argv", [f"{name}.py", *argv])
    return lambda: module.main()


def test_every_benchmark_is_listed():
    assert len(SCRIPTS) > 20


@pytest.mark.parametrize("name", SCRIPTS)
def test_an_unknown_flag_is_refused_in_one_line(monkeypatch, capsys, name):
    refused_line(capsys, run_main(monkeypatch, name, "--no-such-flag"), "--no-such-flag", "--help")
