"""--log-params-norm and --log-num-zeros-in-grad: the model-wide figures of Megatron's log line.

Each parameter counts once, whatever the layout: the single-process run's figures equal torch's
norm of its trained parameters and count of its zero gradient entries, and TP2 (sharded matrices,
replicated layer-norm weights and biases), PP2 (the tied embedding on both stages), CP2, a DP2
distributed optimizer (each rank holding half of the masters and reduced gradients), ZeRO-3 and
MoE at EP2 x TP2 + SP and on a folded ETP2 x EP2 grid (each expert once) log the same figures as
the single process. The zeros counted are exact ones (the embedding rows no
token reaches); --disable-bias-linear leaves out the key bias, whose gradient is zero in theory and
so at the rounding's mercy.
"""

import pytest
import torch

import pretrain_gpt
from megatron_lite.parallel.tensor import VocabParallelEmbedding
from tests.harness import run_ranks

FLAGS = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--vocab-size", "123", "--make-vocab-size-divisible-by", "8", "--mock-data", "--attention-dropout", "0",
    "--hidden-dropout", "0", "--disable-bias-linear", "--lr", "1e-2", "--log-interval", "1", "--eval-iters", "0", "--seed", "7",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "3",
    "--log-params-norm", "--log-num-zeros-in-grad",
]


def _stats(argv):
    """Inside a rank: this run's logged figures per step."""
    return pretrain_gpt.main(argv).stats


@pytest.fixture(scope="module")
def single():
    result = pretrain_gpt.main(FLAGS)
    params = list({id(p): p for c in result.chunks for p in c.parameters() if p.requires_grad}.values())
    norm = torch.linalg.vector_norm(torch.cat([p.detach().float().flatten() for p in params])).item()
    zeros = sum(int((p.main_grad == 0).sum()) for p in params)
    return result.stats, norm, zeros


def test_single_process_equals_torch(single, capsys):
    stats, norm, zeros = single
    assert [sorted(s) for s in stats] == [["num_zeros", "params_norm"]] * 3
    assert stats[-1]["params_norm"] == pytest.approx(norm, rel=1e-6)
    assert stats[-1]["num_zeros"] == zeros > 0
    assert stats[0]["params_norm"] != stats[-1]["params_norm"]  # the figure after each step


def test_logged_on_the_line_and_absent_without_the_flags(capsys):
    stats = pretrain_gpt.main(FLAGS[:-2])
    assert stats.stats == [{}] * 3
    assert "params norm" not in capsys.readouterr().out
    pretrain_gpt.main(FLAGS[:-2] + ["--train-iters", "1", "--log-params-norm", "--log-num-zeros-in-grad"])
    out = capsys.readouterr().out
    assert "| num zeros: " in out and "| params norm: " in out


@pytest.mark.parametrize("layout", [
    ["--tensor-model-parallel-size", "2"],
    ["--pipeline-model-parallel-size", "2"],
    ["--use-distributed-optimizer"],
    ["--data-parallel-sharding-strategy", "optim_grads_params"],
    ["--context-parallel-size", "2"],
], ids=["tp2", "pp2", "dp2_distopt", "dp2_zero3", "cp2"])
def test_parallel_layouts_log_the_single_process_figures(single, layout):
    ref = single[0]
    for stats in run_ranks(2, _stats, FLAGS + layout):  # every rank computes them (collective)
        assert [s["num_zeros"] for s in stats] == [s["num_zeros"] for s in ref]
        for got, want in zip(stats, ref, strict=True):
            assert got["params_norm"] == pytest.approx(want["params_norm"], rel=1e-5)


MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32"]


@pytest.fixture(scope="module")
def single_moe():
    return pretrain_gpt.main(FLAGS + MOE).stats


@pytest.mark.parametrize("layout", [
    ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
    ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2"],  # folded: experts over all 4 ranks
], ids=["ep2_tp2_sp", "etp2_ep2_folded"])
def test_moe_layouts_count_each_expert_once(single_moe, layout):
    """Each expert lives on one EP rank (split over ETP): the figures sum it once, like the dense
    parameters replicated over the expert-data-parallel ranks."""
    ref = single_moe
    for stats in run_ranks(4, _stats, FLAGS + MOE + layout):
        assert [s["num_zeros"] for s in stats] == [s["num_zeros"] for s in ref]
        for got, want in zip(stats, ref, strict=True):
            assert got["params_norm"] == pytest.approx(want["params_norm"], rel=1e-5)


def _stats_and_padding(argv, real_rows):
    """Inside a rank: (this run's figures per step, the sum of squares of the padding rows of the word
    embedding this rank holds, and their count)."""
    result = pretrain_gpt.main(argv)
    table = next(m for c in result.chunks for m in c.modules() if isinstance(m, VocabParallelEmbedding))
    tail = table.weight.detach()[max(real_rows - table.vocab_start, 0):]
    return result.stats, float(tail.double().pow(2).sum()), tail.shape[0]


def test_padding_rows_count_where_the_layout_pads_more():
    """The padding rows are parameters, as in Megatron-LM: with --make-vocab-size-divisible-by 10, 124
    rows (123 ids and the EOD) pad to 130 in one process and to 140 at TP2, and TP2 logs exactly 10 rows more of zero
    gradients and those rows' weights in the norm (the figures equal one process' only at the same
    padded size, as every other test of this file has)."""
    i = FLAGS.index("--make-vocab-size-divisible-by")
    flags = FLAGS[:i + 1] + ["10"] + FLAGS[i + 2:]
    ref, ref_tail, ref_rows = _stats_and_padding(flags, 124)  # 123 ids and the mock tokenizer's EOD
    ranks = run_ranks(2, _stats_and_padding, flags + ["--tensor-model-parallel-size", "2"], 124)
    assert (ref_rows, [r[2] for r in ranks]) == (6, [0, 16])
    hidden = int(FLAGS[FLAGS.index("--hidden-size") + 1])
    extra = sum(r[1] for r in ranks) - ref_tail  # the 10 rows TP2 pads more, at the last step (~0.14)
    assert extra > 0.05
    for stats, _, _ in ranks:
        assert [s["num_zeros"] - w["num_zeros"] for s, w in zip(stats, ref, strict=True)] == [10 * hidden] * 3
        assert stats[-1]["params_norm"] ** 2 - ref[-1]["params_norm"] ** 2 == pytest.approx(extra, abs=2e-3)  # fp32 norm


def test_a_skipped_fp16_step_counts_no_zeros(capsys):
    result = pretrain_gpt.main(FLAGS + ["--fp16", "--initial-loss-scale", "1e30", "--train-iters", "1"])
    assert result.skipped_iterations == 1
    assert result.stats[0]["num_zeros"] is None and result.stats[0]["params_norm"] > 0
    assert "num zeros" not in capsys.readouterr().out
