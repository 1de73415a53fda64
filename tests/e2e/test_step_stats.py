"""--log-params-norm and --log-num-zeros-in-grad: the model-wide figures of Megatron's log line.

Each parameter counts once, whatever the layout: the single-process run's figures equal torch's
norm of its trained parameters and count of its zero gradient entries, and TP2 (sharded matrices,
replicated layer-norm weights and biases), PP2 (the tied embedding on both stages) and a DP2
distributed optimizer (each rank holding half of the masters and reduced gradients) log the
same figures as the single process. The zeros counted are exact ones (the embedding rows no
token reaches); --disable-bias-linear leaves out the key bias, whose gradient is zero in theory and
so at the rounding's mercy.
"""

import pytest
import torch

import pretrain_gpt
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
], ids=["tp2", "pp2", "dp2_distopt", "dp2_zero3"])
def test_parallel_layouts_log_the_single_process_figures(single, layout):
    ref = single[0]
    for stats in run_ranks(2, _stats, FLAGS + layout):  # every rank computes them (collective)
        assert [s["num_zeros"] for s in stats] == [s["num_zeros"] for s in ref]
        for got, want in zip(stats, ref, strict=True):
            assert got["params_norm"] == pytest.approx(want["params_norm"], rel=1e-5)


def test_a_skipped_fp16_step_counts_no_zeros(capsys):
    result = pretrain_gpt.main(FLAGS + ["--fp16", "--initial-loss-scale", "1e30", "--train-iters", "1"])
    assert result.skipped_iterations == 1
    assert result.stats[0]["num_zeros"] is None and result.stats[0]["params_norm"] > 0
    assert "num zeros" not in capsys.readouterr().out
