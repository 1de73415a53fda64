"""The command line's promise for bad input, checked one way everywhere: exit code 2 and one line on
stderr that names what is wrong (and the fix)."""

import pytest

from megatron_lite.arguments import parse_args


def refused_line(capsys, call, *words) -> str:
    """Run ``call()``: it must exit with code 2 after printing one line on stderr that holds every
    one of ``words``. Returns that line."""
    with pytest.raises(SystemExit) as err:
        call()
    assert err.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def parse_refused(capsys, argv, *words, world_size=None) -> str:
    """:func:`refused_line` of ``parse_args(argv, world_size=world_size)``."""
    return refused_line(capsys, lambda: parse_args(argv, world_size=world_size), *words)
