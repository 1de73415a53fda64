"""--decoupled-lr / --decoupled-min-lr through pretrain_gpt.py: the word embedding and output layer
(a tied copy on the last pipeline stage included) follow their own learning rate and nothing else
does; PP2 (tied), DP2 with the distributed optimizer and DP2 under ZeRO-3 reproduce the single-process run (losses,
gradient norms 1e-5, merged weights); a run saved half-way resumes bit for bit, also from a checkpoint
saved without the flag (the optimizer state's layout does not depend on it)."""

import pytest
import torch

import pretrain_gpt
from megatron_lite.checkpoint import merge_checkpoint
from tests.e2e.test_pretrain_gpt import MODEL, MODEL_B, _argv, _parallel, _same_weights, _single
from tests.trajectory import Trajectory, assert_same_trajectory

ITERS = 4
DECOUPLED = ["--decoupled-lr", "3e-3", "--decoupled-min-lr", "1e-4"]
OWN_LR = ("embedding.word_embeddings.weight", "output_layer.weight")


def _weights(tmp_path, name, extra):
    save = str(tmp_path / name)
    pretrain_gpt.main(_argv(save, ITERS, MODEL + extra))
    return merge_checkpoint(save)[0]


@pytest.mark.parametrize("variant", [[], MODEL_B], ids=["tied", "untied"])
def test_a_zero_decoupled_lr_freezes_exactly_the_embedding_and_output_layer(tmp_path, variant):
    frozen = _weights(tmp_path, "frozen", variant + ["--lr", "0"])  # the initial weights
    trained = _weights(tmp_path, "trained", variant + ["--decoupled-lr", "0"])
    own = [k for k in frozen if k in OWN_LR]
    assert own == [k for k in OWN_LR if k in frozen] and own  # tied: the output layer has no weight of its own
    for name, value in frozen.items():
        if not torch.is_tensor(value) or not value.is_floating_point():
            continue
        same = torch.equal(trained[name], value)
        assert same == (name in OWN_LR), name  # positions, layers and norms train at --lr


@pytest.mark.parametrize("name, world, extra", [
    ("pp2_tied", 2, ["--pipeline-model-parallel-size", "2"]),
    ("dp2_distopt_untied", 2, MODEL_B + ["--use-distributed-optimizer"]),
    ("dp2_zero3_tied", 2, ["--data-parallel-sharding-strategy", "optim_grads_params"]),
])
def test_parallel_runs_reproduce_single_process(tmp_path, name, world, extra):
    variant = MODEL_B if "untied" in name else []
    ref, ref_save = _single(tmp_path, "single", ITERS, variant + DECOUPLED)
    got, save = _parallel(tmp_path, name, world, ITERS, extra + DECOUPLED)
    assert_same_trajectory(got, ref, steps=ITERS)
    _same_weights(save, ref_save)
    plain, _ = _single(tmp_path, "plain", ITERS, variant)
    assert plain.losses[2:] != ref.losses[2:]  # the decoupled lr changed the run


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_resume_continues_exactly(tmp_path, fmt):
    ckpt = ["--ckpt-format", fmt]
    full = Trajectory.of(pretrain_gpt.main(_argv(str(tmp_path / "full"), ITERS, MODEL + DECOUPLED + ckpt)))
    half = str(tmp_path / "half")
    pretrain_gpt.main(_argv(half, ITERS, MODEL + DECOUPLED + ckpt + ["--exit-interval", "2"]))
    resumed = Trajectory.of(pretrain_gpt.main(_argv(str(tmp_path / "r"), ITERS, MODEL + DECOUPLED + ckpt + ["--load", half])))
    assert resumed.losses == full.losses[2:] and resumed.grad_norms == full.grad_norms[2:]


def test_a_checkpoint_saved_without_the_flag_resumes_with_it(tmp_path):
    """--decoupled-lr equal to --lr regroups the optimizer but is the same run: resuming a plain
    checkpoint with it continues the plain trajectory exactly (Adam's moments land on their params)."""
    full = Trajectory.of(pretrain_gpt.main(_argv(str(tmp_path / "full"), ITERS, MODEL)))
    half = str(tmp_path / "half")
    pretrain_gpt.main(_argv(half, ITERS, MODEL + ["--exit-interval", "2"]))
    same = ["--decoupled-lr", "1e-2", "--override-opt_param-scheduler"]  # MODEL's --lr
    resumed = Trajectory.of(pretrain_gpt.main(_argv(str(tmp_path / "r"), ITERS, MODEL + same + ["--load", half])))
    assert resumed.losses == full.losses[2:] and resumed.grad_norms == full.grad_norms[2:]
