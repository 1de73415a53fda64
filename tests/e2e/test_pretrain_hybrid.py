"""Hybrid Mamba-2 models through pretrain_gpt.py's command line (pattern M*M-: Mamba, attention, Mamba, MLP).

* PP 2 (layers M* on the first stage, M- on the second), DP 2 with the distributed optimizer and TP 2
  with sequence parallelism follow the one-process run step by step (losses and gradient norms,
  rtol 1e-5), and the TP 2 run's torch_dist checkpoint, saved by two ranks, resumes in one process exactly where
  the one-process run goes on (the group-major in_proj rows slice the same for every TP size).
* A one-process run stopped after 2 of 4 steps and resumed gives the same losses bit for bit; the
  checkpoint records the pattern and the Mamba sizes, and a resume with another pattern is refused in
  one line naming --hybrid-override-pattern. Generation (no Mamba state cache) and a Hugging Face
  export of the checkpoint are refused in one line (exit 2).
"""

import pytest

import pretrain_gpt
from megatron_lite.checkpoint.format import CheckpointError
from megatron_lite.inference.loading import load_model
from tests.convert_helpers import convert
from tests.e2e.test_pretrain_gpt import _argv, _one_line_exit_2
from tests.trajectory import Trajectory, assert_same_trajectory, ranks_trajectory, run_script

HYBRID = ["--hybrid-override-pattern", "M*M-", "--mamba-state-dim", "16", "--mamba-head-dim", "16",
          "--mamba-num-groups", "2", "--normalization", "RMSNorm"]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    return run_script("pretrain_gpt", _argv(str(tmp_path_factory.mktemp("one") / "one"), 4, HYBRID))


def test_tp2_sp_pp2_and_dp2_follow_one_process_and_its_checkpoint_resumes_in_one_process(tmp_path, straight):
    save = str(tmp_path / "tp2")
    got = ranks_trajectory(2, "pretrain_gpt", _argv(save, 4, HYBRID + TP2_SP + ["--exit-interval", "2",
                                                                               "--ckpt-format", "torch_dist"]))
    assert_same_trajectory(got, straight[:2], steps=2, what="TP2+SP")
    pp2 = ranks_trajectory(2, "pretrain_gpt", _argv(str(tmp_path / "pp2"), 4, HYBRID + ["--pipeline-model-parallel-size", "2",
                                                                                     "--exit-interval", "2"]))
    assert_same_trajectory(pp2, straight[:2], steps=2, what="PP2")
    dp2 = ranks_trajectory(2, "pretrain_gpt", _argv(str(tmp_path / "dp2"), 4, HYBRID + ["--use-distributed-optimizer",
                                                                                     "--exit-interval", "2"]))
    assert_same_trajectory(dp2, straight[:2], steps=2, what="DP2 with the distributed optimizer")
    rest = run_script("pretrain_gpt", _argv(str(tmp_path / "rest"), 4, HYBRID + ["--load", save, "--ckpt-format", "torch_dist",
                                                                                "--no-load-rng"]))
    assert_same_trajectory(rest, straight[2:], steps=2, what="TP2+SP checkpoint resumed in one process")


def test_resume_continues_exactly_and_another_pattern_is_refused(tmp_path, capsys, straight):
    save = str(tmp_path / "resumed")
    first = pretrain_gpt.main(_argv(save, 4, HYBRID + ["--exit-interval", "2"]))
    second = pretrain_gpt.main(_argv(save, 4, HYBRID + ["--load", save]))
    assert_same_trajectory(Trajectory.of(first) + Trajectory.of(second), straight, rtol=0)  # bit-identical
    other = [a if a != "M*M-" else "MM*-" for a in HYBRID]
    _one_line_exit_2(capsys, _argv(str(tmp_path / "other"), 4, other + ["--load", save]), "--hybrid-override-pattern")
    with pytest.raises(CheckpointError, match="hybrid Mamba model: text generation of it is not built"):
        load_model(save)
    capsys.readouterr()
    assert convert("GPT", "--saver", "hf", "--load-dir", save, "--save-dir", str(tmp_path / "hf")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "hybrid Mamba" in err[0] and "export is refused" in err[0], err
