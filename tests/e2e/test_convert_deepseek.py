"""A Hugging Face DeepSeek-V3 model imported with tools/checkpoint/convert.py trains in pretrain_gpt.py
at TP2 (sequence parallel) x PP2 x EP2 with the losses (main and ``mtp_1 loss``) and gradient norms
of the same import trained in one process (:func:`tests.trajectory.assert_same_trajectory`).

The model is the unit tests' ``v3`` variant (tests/unit/test_hf_deepseek.py: q compression, YaRN,
first layer dense, 4 experts top-2 in 2 groups with a correction bias and a shared expert, MTP 1
written in DeepSeek's layout). Both runs use the flags the converter prints, start from the
release checkpoint (iteration 0) and train from the imported weights.
"""

import shlex

import pytest

from tests.convert_helpers import convert
from tests.trajectory import assert_same_trajectory, ranks_trajectory, run_script

pytest.importorskip("transformers")

ITERS = 5  # past the 2 warm-up steps (was 6); the reference's 5th loss is below its first
RUN = ["--mock-data", "--vocab-size", "99",  # NullTokenizer: 99 + EOD = 100
       "--seq-length", "16", "--micro-batch-size", "2",
       "--global-batch-size", "8", "--train-iters", str(ITERS), "--lr", "1e-2", "--lr-warmup-iters", "2",
       "--clip-grad", "1.0", "--eval-iters", "0", "--log-interval", "1", "--seed", "7",
       "--moe-token-dispatcher-type", "alltoall", "--moe-router-bias-update-rate", "1e-2"]
LAYOUT = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "2",
          "--expert-model-parallel-size", "2"]


def _import(capsys, folder, out, *layout):
    capsys.readouterr()
    assert convert("GPT", "--loader", "hf", "--load-dir", folder, "--save-dir", out, "--moe-grouped-gemm",
                   *layout) == 0
    printed = shlex.split(capsys.readouterr().out.split("load it with: ")[1].split(" (and the tokenizer flags)")[0])
    assert "--mtp-num-layers" in printed and "--moe-router-enable-expert-bias" in printed, printed
    return printed


def test_imported_model_trains_at_tp2_pp2_ep2_like_one_process(tmp_path, capsys):
    from tests.unit.test_hf_deepseek import _write_hf

    folder = str(tmp_path / "hf")
    _write_hf("v3", folder)
    single = _import(capsys, folder, str(tmp_path / "tp1"))
    parallel = _import(capsys, folder, str(tmp_path / "tp2pp2ep2"), "--target-tensor-parallel-size", 2,
                       "--target-pipeline-parallel-size", 2, "--target-expert-parallel-size", 2)
    reference = run_script("pretrain_gpt", single + RUN)
    assert len(reference) == ITERS and {"lm loss", "mtp_1 loss"} <= set(reference.reported[0])
    assert reference.losses[-1] < reference.losses[0], "did not train"
    actual = ranks_trajectory(8, "pretrain_gpt", parallel + RUN + LAYOUT)
    assert_same_trajectory(actual, reference, steps=ITERS, what="HF import at TP2 x PP2 x EP2")
