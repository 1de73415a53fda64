"""--data-parallel-random-init (Megatron-LM's flag) at DP2: each replica seeds its streams with its own
offset (a module drawn from them differs per replica; so do the dropout masks), the first replica's
weights are broadcast before training (every replica ends with the same weights), and a run stopped
and resumed continues bit for bit (each rank's RNG file keeps its own streams)."""

import torch

import pretrain_gpt
from megatron_lite.config import Config
from megatron_lite.parallel.random import model_parallel_seed
from megatron_lite.training.dp_random_init import broadcast_from_first_replica, seed_offset
from tests.e2e.test_resume_dropout import DROPOUT
from tests.harness import cached_state, run_ranks
from tests.trajectory import Trajectory, assert_same_trajectory

FLAG = ["--data-parallel-random-init", "--train-iters", "4"]


def _draw_then_broadcast(flag: bool):
    state = cached_state()  # world 2: DP2
    config = Config()
    config.training.data_parallel_random_init = flag
    model_parallel_seed(config.training.seed + seed_offset(config, state), state)
    layer = torch.nn.Linear(4, 4)  # drawn from the default stream
    drawn = layer.weight.detach().clone()
    broadcast_from_first_replica([layer], state)
    return drawn, layer.weight.detach().clone()


def test_each_replica_draws_its_own_and_starts_from_the_first_ones():
    (d0, b0), (d1, b1) = run_ranks(2, _draw_then_broadcast, True)
    assert not torch.equal(d0, d1) and torch.equal(b0, d0) and torch.equal(b1, d0)
    (p0, _), (p1, _) = run_ranks(2, _draw_then_broadcast, False)
    assert torch.equal(p0, p1) and torch.equal(p0, d0)  # replica 0's offset is 0: the flag-less draw


def _run(argvs):
    """Inside a rank: each run's trajectory, and the final weights of the last one."""
    out = []
    for argv in argvs:
        result = pretrain_gpt.main(argv)
        out.append(Trajectory.of(result))
    weights = {n: p.detach().clone() for n, p in result.chunks[0].named_parameters()}
    return out, weights


def test_replicas_keep_the_same_weights_and_resume_bit_for_bit(tmp_path):
    save = str(tmp_path / "ckpt")
    argvs = [DROPOUT + ["--train-iters", "4"], DROPOUT + FLAG, DROPOUT + FLAG + ["--save", save, "--exit-interval", "2"],
             DROPOUT + FLAG + ["--save", save, "--load", save]]
    (runs0, w0), (runs1, w1) = run_ranks(2, _run, argvs)
    assert runs0 == runs1  # the losses are averaged over the replicas, the gradient norm global
    plain, straight, first, resumed = runs0
    # the same weights and batches: replica 1's dropout masks differ, so the mean loss of step 1 already does
    assert plain.losses[0] != straight.losses[0]
    assert len(first) == 2 and len(resumed) == 2
    assert_same_trajectory(first + resumed, straight, rtol=0)
    for name, w in w0.items():
        assert torch.equal(w, w1[name]), name
