"""The converter's closing lines after an import: how many ranks the written layout needs, and the
flags to load it with (which must parse at that many ranks and not at fewer)."""

import shlex

import pytest

from megatron_lite.arguments import parse_args
from tests.convert_helpers import convert
from tests.unit.test_hf_qwen3 import VOCAB, qwen3_moe

pytest.importorskip("transformers")


@pytest.mark.parametrize("target, world", [((2, 2, None), 4), ((1, 2, 2), 4), ((2, 1, None), 2)],
                         ids=["tp2 ep2", "folded etp2 ep2", "tp2 ep1"])
def test_printed_flags_and_ranks_fit_the_written_layout(tmp_path, capsys, target, world):
    """An import at TP2 x EP2 printed flags without --expert-tensor-parallel-size, which defaults to TP:
    the experts' ETP2 x EP2 grid needs a data-parallel size of 2, so the flags fail on 2 ranks, and the
    output did not say so. The line before the flags says how many ranks; the flags parse there, and
    not on fewer."""
    tp, ep, etp = target
    qwen3_moe().save_pretrained(str(tmp_path / "hf"))
    extra = [] if etp is None else ["--target-expert-tensor-parallel-size", etp]
    assert convert("GPT", "--loader", "hf", "--load-dir", tmp_path / "hf", "--save-dir", tmp_path / "out",
                   "--make-vocab-size-divisible-by", 8, "--target-tensor-parallel-size", tp,
                   "--target-expert-parallel-size", ep, *extra) == 0
    out = capsys.readouterr().out
    ranks = out.split("\nload it with: ")[0].splitlines()[-1]
    assert ranks.startswith(f"run it on a multiple of {world} ranks (TP{tp} x PP1"), ranks
    flags = shlex.split(out.split("load it with: ")[1].split(" (and the tokenizer flags)")[0])[2:]
    if ep > 1 and tp > 1:
        assert flags[flags.index("--expert-tensor-parallel-size") + 1] == str(tp)
    config = parse_args(flags + ["--mock-data", "--vocab-size", str(VOCAB)], world_size=world)
    assert config.flat()["expert_model_parallel_size"] == ep
    if world > tp:
        with pytest.raises(SystemExit) as err:
            parse_args(flags + ["--mock-data", "--vocab-size", str(VOCAB)], world_size=world // 2)
        assert err.value.code == 2


def test_the_ranks_line_of_each_layout():
    from megatron_lite.checkpoint.convert import ranks_needed
    from megatron_lite.checkpoint.reshard import TargetLayout

    assert ranks_needed(TargetLayout(), False) == "run it on any number of ranks (TP1 x PP1: data- or context-parallel)"
    assert ranks_needed(TargetLayout(2, 2), False).startswith("run it on a multiple of 4 ranks (TP2 x PP2, times")
    assert ranks_needed(TargetLayout(2, ep=2, etp=1), True).startswith("run it on a multiple of 4 ranks (TP2 x PP1 x DP2")
    assert ranks_needed(TargetLayout(2, ep=4, etp=4), True).startswith("run it on a multiple of 16 ranks (TP2 x PP1 x DP8")
    assert ranks_needed(TargetLayout(2, ep=2, etp=1, dp=1), True).startswith("run it on a multiple of 2 ranks")
