"""Hybrid sharding and optimizer CPU offload through pretrain_gpt.py's command line.

Every run must reproduce the single-process trajectory (fp32: losses and gradient norms within a relative 1e-5, final
weights as in test_pretrain_gpt.py), and the model-state bytes each rank holds, measured from the
tensors' storages, must equal the formula exactly, device and CPU parts apart. The model (MODEL_B:
no biases, hidden 32) has only even-sized parameters, so no gradient bucket needs padding at a
shard size of 2 and the per-rank formula is exact. Its gradient norms are about 0.76-0.98, so
--clip-grad 0.78 (MODEL_C) clips most steps, in the device and the host half of an offloaded
optimizer; at MODEL_B's --clip-grad 1.0 no step clipped, and a host half stepping unclipped
gradients (tried) passed every test here.
"""

from fractions import Fraction

import pytest
import torch

import pretrain_gpt
from megatron_lite.perf.model_state import measured_model_state_bytes, model_state_bytes_split
from tests.e2e.test_pretrain_gpt import MODEL, MODEL_B, _argv, _one_line_exit_2, _same_weights
from tests.harness import run_ranks
from tests.trajectory import Trajectory, assert_same_trajectory

ITERS = 6  # past the 2 warm-up steps; the offloaded resume stops at 4 and continues 2
CLIP = 0.78
MODEL_C = MODEL_B + ["--clip-grad", str(CLIP)]  # the model every run of this file trains
DISTOPT = ["--use-distributed-optimizer"]
OFFLOAD_HALF = DISTOPT + ["--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5",
                          "--overlap-cpu-optimizer-d2h-h2d"]


def run_and_measure(argv):
    """Inside a rank: train; return (trajectory, this rank's parameter count, measured bytes)."""
    result = pretrain_gpt.main(argv)
    n = sum(p.numel() for c in result.chunks for p in c.parameters())
    return Trajectory.of(result), n, measured_model_state_bytes(result.chunks, result.optimizer)


def _run(tmp_path, name, world, extra, iters=ITERS, model=MODEL_C):
    save = str(tmp_path / name)
    argv = _argv(save, iters, model + list(extra))
    results = run_ranks(world, run_and_measure, argv) if world > 1 else [run_and_measure(argv)]
    for other in results[1:]:
        assert other[0] == results[0][0]  # every rank reports the same DP-averaged losses and global norms
    return results, save


def _bytes_match_formula(results, dtype, d, instances=1, fraction=0.0, strategy="optim"):
    device, cpu = model_state_bytes_split(dtype, strategy, d, instances=instances, offload_fraction=fraction)
    for _, n, got in results:
        assert got["params"] + got["grads"] + got["optimizer"] == device * n, got
        assert got["optimizer_cpu"] == cpu * n, got
    return device, cpu


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sharded_ref")
    out = {}
    results, save = _run(tmp, "single_fp32", 1, [])
    out["fp32"] = results[0][0], save
    assert sum(norm > CLIP for norm in out["fp32"][0].grad_norms) >= ITERS // 2  # clipping is active
    results, save = _run(tmp, "single_bf16", 1, ["--bf16"], model=MODEL_B)  # unclipped: see test_cpu_offload_in_bf16
    out["bf16"] = results[0][0], save
    return out


def test_hybrid_sharding_dp4_two_instances(tmp_path, reference):
    # Two instances of 2 shards; small overlapped buckets: the replica all-reduce runs at wait time.
    extra = DISTOPT + ["--num-distributed-optimizer-instances", "2", "--overlap-grad-reduce", "--ddp-bucket-size", "3000"]
    results, save = _run(tmp_path, "hybrid", 4, extra)
    ref, ref_save = reference["fp32"]
    assert_same_trajectory(results[0][0], ref, steps=ITERS)
    _same_weights(save, ref_save)
    device, _ = _bytes_match_formula(results, torch.float32, 4, instances=2)
    assert device == 8 + 6  # 4 param + 4 grad + 12 / (4 / 2) master and moments


# DP 2 x CP 2, two instances: each shard block is one CP group, the replicas are the DP ranks.
# DP 1 x CP 4 under ZeRO-3 (refused while the instances had to divide DP): each block is half of the
# CP group; parameters gathered, gradients reduce-scattered in a block, all-reduced across the two.
@pytest.mark.parametrize("cp, strategy", [(2, "optim"), (4, "optim_grads_params")])
def test_hybrid_sharding_with_context_parallelism(tmp_path, reference, cp, strategy):
    extra = DISTOPT + ["--num-distributed-optimizer-instances", "2", "--context-parallel-size", str(cp),
                       "--data-parallel-sharding-strategy", strategy]
    results, save = _run(tmp_path, "hybrid_cp", 4, extra)
    assert_same_trajectory(results[0][0], reference["fp32"][0], steps=ITERS)
    _same_weights(save, reference["fp32"][1])
    _bytes_match_formula(results, torch.float32, 4, instances=2, strategy=strategy)


def test_cpu_offload_all_of_the_shard(tmp_path, reference, capsys):
    extra = DISTOPT + ["--optimizer-cpu-offload"]
    results, save = _run(tmp_path, "offload_all", 1, extra)
    assert_same_trajectory(results[0][0], reference["fp32"][0], steps=ITERS)
    _same_weights(save, reference["fp32"][1])
    assert _bytes_match_formula(results, torch.float32, 1, fraction=1.0) == (8, 16)
    # the line printed after the first step: measured next to the formula
    assert ("optimizer 0.00 = device 8.00; optimizer on CPU 16.00 | formula for optim (d=1, instances 1, "
            "offload 1): device 8.00, CPU 16.00") in capsys.readouterr().out


def test_cpu_offload_half_at_dp2_and_resume_is_exact(tmp_path, reference):
    results, save = _run(tmp_path, "offload_half", 2, OFFLOAD_HALF)
    straight = results[0][0]
    assert_same_trajectory(straight, reference["fp32"][0], steps=ITERS)
    _same_weights(save, reference["fp32"][1])
    assert _bytes_match_formula(results, torch.float32, 2, fraction=0.5) == (8 + 3, 4)
    # stop at 4, resume from the checkpoint: the continuation is bit-identical
    resumed = str(tmp_path / "offload_resumed")
    first = run_ranks(2, run_and_measure, _argv(resumed, ITERS, MODEL_C + OFFLOAD_HALF + ["--exit-interval", "4"]))
    second = run_ranks(2, run_and_measure, _argv(resumed, ITERS, MODEL_C + OFFLOAD_HALF + ["--load", resumed]))
    assert_same_trajectory(first[0][0] + second[0][0], straight, rtol=0)  # bit-identical


def test_cpu_offload_in_bf16(tmp_path, reference):
    # bf16 params: the host half steps the same fp32 masters, so only the DP2 summation order differs
    # from the single process; losses and gradient norms agree within a relative 1e-4 (measured: 1e-7).
    # Not clipped (MODEL_B): a clip factor from a norm summed in another order moves bf16 roundings, and
    # then the runs drift apart by 1e-4 within 5 steps (the distributed optimizer without offload too).
    results, _ = _run(tmp_path, "offload_bf16", 2, OFFLOAD_HALF + ["--bf16"], model=MODEL_B)
    assert_same_trajectory(results[0][0], reference["bf16"][0], rtol=1e-4, steps=ITERS)
    assert _bytes_match_formula(results, torch.bfloat16, 2, fraction=0.5) == (6 + 3, 4)


@pytest.mark.parametrize("name, world, strategy, instances", [
    ("zero3_offload_half_dp2", 2, "optim_grads_params", 1),
    ("zero2_hsdp_offload_half_dp4", 4, "optim_grads", 2),
])
def test_cpu_offload_with_sharded_grads_and_params(tmp_path, reference, name, world, strategy, instances):
    """ZeRO-2/3 with half of the optimizer shard on the host (ZeRO-3: the host half writes its updated
    values into the parameter shard; ZeRO-2 here also in 2 instances of 2): the single-process
    trajectory and weights, and the formula's device and CPU bytes exactly."""
    extra = OFFLOAD_HALF + ["--data-parallel-sharding-strategy", strategy,
                            "--num-distributed-optimizer-instances", str(instances)]
    results, save = _run(tmp_path, name, world, extra)
    assert_same_trajectory(results[0][0], reference["fp32"][0], steps=ITERS)
    _same_weights(save, reference["fp32"][1])
    device, cpu = _bytes_match_formula(results, torch.float32, world, instances, 0.5, strategy)
    shard = world // instances  # 2 either way: ZeRO-3 (4 + 4 + 6) / 2, ZeRO-2 4 + (4 + 6) / 2; CPU 16 x 0.5 / 2
    assert (device, cpu) == ({"optim_grads_params": 7, "optim_grads": 9}[strategy], Fraction(8, shard)), (device, cpu)


@pytest.mark.parametrize(
    "flags, world, words",
    [
        (["--num-distributed-optimizer-instances", "2"], 4,
         ["--num-distributed-optimizer-instances > 1 needs --use-distributed-optimizer or a --data-parallel-sharding-strategy"]),
        (DISTOPT + ["--num-distributed-optimizer-instances", "3"], 4,
         ["num-distributed-optimizer-instances 3", "data-parallel size 4"]),
        (DISTOPT + ["--num-distributed-optimizer-instances", "0"], 4, ["--num-distributed-optimizer-instances"]),
        # DP 4 / EP 4 leaves one expert-DP rank: two instances cannot split it
        (DISTOPT + ["--num-distributed-optimizer-instances", "2", "--num-experts", "4", "--expert-model-parallel-size",
                    "4"], 4, ["--num-distributed-optimizer-instances 2", "expert data-parallel size 1",
                              "--expert-model-parallel-size 4"]),
        (["--optimizer-cpu-offload"], 1, ["--optimizer-cpu-offload needs --use-distributed-optimizer"]),
        (DISTOPT + ["--optimizer-cpu-offload", "--optimizer-offload-fraction", "1.5"], 1,
         ["--optimizer-offload-fraction must be between 0 and 1"]),
        (DISTOPT + ["--overlap-cpu-optimizer-d2h-h2d"], 1, ["--overlap-cpu-optimizer-d2h-h2d needs --optimizer-cpu-offload"]),
        (DISTOPT + ["--optimizer-offload-fraction", "0.5"], 1, ["--optimizer-offload-fraction needs"]),
        # HSDP (ZeRO-3 in instances) refuses only what does not divide
        (["--data-parallel-sharding-strategy", "optim_grads_params", "--num-distributed-optimizer-instances", "3"], 4,
         ["num-distributed-optimizer-instances 3", "data-parallel size 4"]),
    ],
)
def test_bad_sharding_flags_exit_2_with_one_line(capsys, monkeypatch, flags, world, words):
    monkeypatch.setenv("WORLD_SIZE", str(world))  # validated before any process group is made
    _one_line_exit_2(capsys, MODEL + ["--micro-batch-size", "2"] + flags, *words)


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_offloaded_checkpoint_resumes_without_offload(tmp_path, reference, strategy):
    """The checkpoint format does not change: stop an offloaded run (ZeRO-1 or ZeRO-3), go on with
    ZeRO-1 without offload."""
    save = str(tmp_path / "fmt")
    first = pretrain_gpt.main(_argv(save, ITERS, MODEL_C + DISTOPT + ["--data-parallel-sharding-strategy", strategy,
                                                                      "--optimizer-cpu-offload", "--exit-interval", "3"]))
    second = pretrain_gpt.main(_argv(save, ITERS, MODEL_C + DISTOPT + ["--load", save]))
    assert_same_trajectory(Trajectory.of(first) + Trajectory.of(second), reference["fp32"][0], steps=ITERS)


AWARE = ["--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]


def test_bf16_moments_with_zero3_and_offload_resume_bit_for_bit_from_torch_dist(tmp_path, reference):
    """--use-precision-aware-optimizer with bf16 moments at DP2 under ZeRO-3 with half of the shard on the
    host: stopped at step 4 and resumed from its torch_dist checkpoint (moments saved in bf16) it is bit for bit
    the straight run, which follows fp32 Adam's single-process trajectory within bf16 moment rounding; the
    checkpoint resumes an fp32-moment run and that run's checkpoint a bf16-moment one (the moments cast); the
    model state holds 4 bytes of moments per element (the formula's ``moments=4``: device and CPU exactly)."""
    extra = OFFLOAD_HALF + AWARE + ["--data-parallel-sharding-strategy", "optim_grads_params", "--ckpt-format",
                                    "torch_dist"]
    results, _ = _run(tmp_path, "aware_straight", 2, extra)
    straight = results[0][0]
    resumed = str(tmp_path / "aware_resumed")
    first = run_ranks(2, run_and_measure, _argv(resumed, ITERS, MODEL_C + extra + ["--exit-interval", "4"]))
    # the bf16 moments loaded into an fp32-moment run (widened, exact): step 5 as the straight run's, bit for
    # bit; step 6 within the one rounding of step 5's moments that the fp32 run no longer makes
    fp32_moments = [a for a in extra if a not in AWARE]  # fp32 Adam
    cast = run_ranks(2, run_and_measure, _argv(str(tmp_path / "cast"), ITERS, MODEL_C + fp32_moments + [
        "--load", resumed]))[0][0]
    assert cast.losses[0] == straight.losses[4] and cast.losses[1] == pytest.approx(straight.losses[5], rel=1e-5)
    # and back: that run's fp32 moments (iteration 6) into a bf16-moment run that loads and stops (no step):
    # its model state is already the formula's, the moments rounded to bf16 on load
    loaded = run_ranks(2, run_and_measure, _argv(str(tmp_path / "loaded"), ITERS, MODEL_C + extra + [
        "--load", str(tmp_path / "cast")]))
    second = run_ranks(2, run_and_measure, _argv(resumed, ITERS, MODEL_C + extra + ["--load", resumed]))
    assert_same_trajectory(first[0][0] + second[0][0], straight, rtol=0)  # bit-identical
    assert_same_trajectory(straight, reference["fp32"][0], rtol=1e-3, steps=ITERS)
    device, cpu = model_state_bytes_split(torch.float32, "optim_grads_params", 2, offload_fraction=0.5, moments=4)
    for _, n, got in results + loaded:  # after training, and right after the load (no step: the loaded dtype)
        assert got["optimizer"] + got["optimizer_cpu"] > 0
        assert (got["params"] + got["grads"] + got["optimizer"], got["optimizer_cpu"]) == (device * n, cpu * n), got
    assert (device, cpu) == (6, 3)  # (4 + 4) / 2 + (4 + 4) x 0.5 / 2 and (8 + 4) x 0.5 / 2; fp32 moments: 7 and 4
