"""FP8 training through pretrain_gpt.py's command line.

* Learning: on the sample corpus, FP8 runs of every recipe (hybrid/delayed, hybrid/tensorwise,
  e4m3/delayed, e4m3/blockwise, hybrid/mxfp8) stay within 2% of the bf16 run's loss at every one of
  20 steps and within 1-6% of its gradient norms over the first 10, and learned.
* Tensor (TP2 + SP), pipeline (PP2) and data parallelism (DP2) with FP8 follow the one-process FP8
  run step by step within bf16 tolerance: losses relative 1e-3, gradient norms GRAD_RTOL (the
  amaxes are reduced over TP and DP so every rank quantises with the one-process scales; what
  remains is bf16 rounding in a different summation order). After one step every TP rank holds
  exactly the weight scales of the unsharded run.
* Resume: stop after 6 of 12 steps and resume: bit-identical losses (the amax histories and scales
  are in the checkpoint; without them the resumed steps would quantise with scale 1).
* ``--moe-router-padding-for-fp8``: an FP8 MoE run's losses and gradient norms equal the unpadded run's.
* Bad FP8 flags exit with code 2 and one line (the padding flag without FP8, experts or alltoall too).
* ``--transformer-impl transformer_engine`` through the CLI, with the stand-in TE package (no real
  TE here): the run trains, the flags reach TE's recipe, and the losses follow the local bf16 run
  (the stand-in computes in fp32 and never quantises, so within bf16 rounding: relative 2e-2).
"""

import os

import pytest
import torch

import pretrain_gpt
from megatron_lite.checkpoint.dist_read import read_index
from megatron_lite.checkpoint.format import find_model_files, read_model_file
from megatron_lite.checkpoint.merge import merge_checkpoint
from megatron_lite.precision.flags import transformer_engine_missing
from megatron_lite.precision.fp8 import is_fp8_state_key
from tests import fake_transformer_engine as fake_te
from tests.e2e.test_pretrain_gpt import MODEL, _argv, _one_line_exit_2, _real_data, _single
from tests.trajectory import Trajectory, assert_same_trajectory, ranks_trajectory, run_script

FP8 = ["--bf16", "--fp8-format", "hybrid"]
ITERS = 8
# bf16 rounding in another summation order moves the gradient norm more than the loss: the norm
# sums squares of every gradient element, each of which carries bf16's 2^-8 relative rounding
GRAD_RTOL = 1e-2
# FP8 experts: the delayed scaling's amax histories pick up those last-bit differences, and from step
# 4-5 on a scale that differs flips FP8 roundings of whole expert GEMMs (seen: 2.4% at step 6, the
# losses still within 1e-3); a wrong reduction is caught by the weight-scale and one-step checks
MOE_GRAD_RTOL = 5e-2
TE_GRAD_RTOL = 2e-2


def _train_real(sample_dataset, tmp_path, name, extra, trajectory=False):
    argv = _real_data(sample_dataset) + ["--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", "20",
                                         "--data-cache-path", str(tmp_path / "cache"), "--save", str(tmp_path / name)]
    result = pretrain_gpt.main(argv + extra)
    return Trajectory.of(result) if trajectory else result.losses


@pytest.fixture(scope="module")
def bf16_run(sample_dataset, tmp_path_factory):
    return _train_real(sample_dataset, tmp_path_factory.mktemp("bf16"), "bf16", ["--bf16"], trajectory=True)


# Every recipe against the bf16 run, step by step. The losses alone barely notice broken FP8 GEMMs
# (this small model learns mostly through its embeddings: quantising with the inverse scale moved them
# 1.3%), the gradient norms of the first steps do (5% at step 1). Measured, worst over the 20 losses /
# the first 10 gradient norms: hybrid delayed 1.1% / 1.0%, hybrid tensorwise 1.2% / 0.4%, e4m3 delayed
# (E4M3 gradients: less range) 1.3% / 3.3%, e4m3 blockwise 1.2% / 0.3%, hybrid mxfp8 0.3%.
STEP_RTOL, GRAD_STEPS = 2e-2, 10


@pytest.mark.parametrize("recipe, grad_rtol", [
    (["--fp8-format", "hybrid"], 2e-2),
    (["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"], 1e-2),
    (["--fp8-format", "e4m3", "--fp8-amax-history-len", "4", "--fp8-amax-compute-algo", "max"], 6e-2),
    (["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"], 1e-2),
    (["--fp8-format", "hybrid", "--fp8-recipe", "mxfp8"], 1e-2),
], ids=["hybrid_delayed", "hybrid_tensorwise", "e4m3_delayed_max4", "e4m3_blockwise", "hybrid_mxfp8"])
def test_fp8_follows_bf16_step_by_step(sample_dataset, tmp_path, bf16_run, recipe, grad_rtol):
    run = _train_real(sample_dataset, tmp_path, "fp8", ["--bf16"] + recipe, trajectory=True)
    losses, ref = run.losses, bf16_run.losses
    worst = max(abs(a - b) / b for a, b in zip(losses, ref))
    assert len(losses) == len(ref) == 20 and worst <= STEP_RTOL, f"{recipe}: losses {worst:.3g} from bf16"
    pairs = list(zip(run.grad_norms, bf16_run.grad_norms))[:GRAD_STEPS]
    worst = max(abs(a - b) / b for a, b in pairs)
    assert worst <= grad_rtol, f"{recipe}: gradient norms {worst:.3g} from bf16"
    assert losses != ref  # quantised: not the bf16 run itself
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, losses  # it learned


def _saved_scales(save) -> dict:
    """{(tp_rank, pp_rank): {name: scale}} of every FP8 gemm in a save folder's latest checkpoint."""
    out = {}
    for key, path in find_model_files(save).items():
        sd = read_model_file(path)["model"][0]
        out[key] = {k.removeprefix("module."): v for k, v in sd.items() if k.endswith(".gemm.scale")}
    return out


@pytest.fixture(scope="module")
def one_process_fp8(tmp_path_factory):
    return run_script("pretrain_gpt", _argv(str(tmp_path_factory.mktemp("fp8") / "one"), ITERS, FP8))


@pytest.mark.parametrize("name, extra", [
    ("tp2_sp", ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    ("pp2", ["--pipeline-model-parallel-size", "2"]),
    ("dp2", ["--overlap-grad-reduce"]),
])
def test_parallel_fp8_follows_one_process(tmp_path, one_process_fp8, name, extra):
    """TP2 + SP quantises with the unsharded run's scales (amaxes reduced over TP); pipeline stages
    update their own layers' scales; data-parallel replicas agree on theirs (amaxes reduced over
    DP, so both see the whole global batch as one process does). What remains is bf16 rounding in
    another summation order: losses within a relative 1e-3, gradient norms within GRAD_RTOL."""
    got = ranks_trajectory(2, "pretrain_gpt", _argv(str(tmp_path / name), ITERS, FP8 + extra))
    assert_same_trajectory(got, one_process_fp8, rtol=1e-3, grad_rtol=GRAD_RTOL, steps=ITERS, what=name)


def test_tp2_sp_fp8_shards_share_the_unsharded_scales(tmp_path):
    """Losses alone cannot tell shard-local scales from shared ones; the scales can. After one step
    (same weights everywhere) every TP rank must hold the weight scales of the unsharded run; a
    shard without the largest weight would otherwise have a larger scale (by a few percent)."""
    one_step = FP8 + ["--lr-warmup-iters", "0"]
    pretrain_gpt.main(_argv(str(tmp_path / "tp1"), 1, one_step))
    ranks_trajectory(2, "pretrain_gpt", _argv(str(tmp_path / "tp2"), 1, one_step + ["--tensor-model-parallel-size", "2",
                                                                                  "--sequence-parallel"]))
    (ref,) = _saved_scales(str(tmp_path / "tp1")).values()
    for rank, scales in _saved_scales(str(tmp_path / "tp2")).items():
        assert scales.keys() == ref.keys() and len(ref) == 16
        for name, s in scales.items():
            # weights are identical at step 1, so their scales must be too. Inputs and gradients only
            # agree within 10%: step 1 casts with the initial scale 1, where small activations and all
            # gradients fall into FP8's subnormal range and bf16 rounding differences flip FP8 values
            rel = ((s - ref[name]).abs() / ref[name]).tolist()
            assert rel[1] <= 1e-6 and rel[0] <= 0.1 and rel[2] <= 0.1, f"rank {rank} {name}: {s} vs {ref[name]}"


def test_fp8_resume_continues_exactly(tmp_path):
    extra = FP8 + ["--fp8-amax-history-len", "4", "--fp8-amax-compute-algo", "max"]
    straight = run_script("pretrain_gpt", _argv(str(tmp_path / "straight"), 12, extra))
    save = str(tmp_path / "resumed")
    first = pretrain_gpt.main(_argv(save, 12, extra + ["--exit-interval", "6"]))
    state, _ = merge_checkpoint(save)
    scales = [v for k, v in state.items() if k.endswith(".gemm.scale")]
    assert len(scales) == 4 * 4  # 4 layers x (qkv, proj, fc1, fc2); embedding and output layer stay bf16
    assert all(not torch.equal(s, torch.ones(3)) for s in scales)  # the saved scales were learned
    second = pretrain_gpt.main(_argv(save, 12, extra + ["--load", save]))
    assert_same_trajectory(Trajectory.of(first) + Trajectory.of(second), straight, rtol=0)  # bit-identical


def test_block_scaled_resume_continues_exactly_and_loads_under_other_recipes(tmp_path):
    """mxfp8 keeps no scaling state that matters (its unused amax buffers are saved as the other recipes'
    are): a run stopped after 4 of 8 steps resumes bit-identically, and the same checkpoint resumes under
    blockwise and delayed scaling."""
    mx = FP8 + ["--fp8-recipe", "mxfp8", "--ckpt-format", "torch_dist"]
    straight = run_script("pretrain_gpt", _argv(str(tmp_path / "straight"), 8, mx))
    save = str(tmp_path / "resumed")
    first = pretrain_gpt.main(_argv(save, 8, mx + ["--exit-interval", "4"]))
    second = pretrain_gpt.main(_argv(save, 8, mx + ["--load", save]))
    assert_same_trajectory(Trajectory.of(first) + Trajectory.of(second), straight, rtol=0)  # bit-identical
    for recipe in ("blockwise", "delayed"):
        other = FP8 + ["--fp8-recipe", recipe, "--ckpt-format", "torch_dist", "--load", save]
        run = pretrain_gpt.main(_argv(str(tmp_path / recipe), 8, other))
        assert run.iteration == 8 and all(abs(a - b) <= 0.03 * b for a, b in zip(run.losses, second.losses))


def test_fp8_checkpoint_resumes_without_fp8_in_either_format(tmp_path):
    """A run without --fp8-format resuming an FP8 checkpoint (e.g. one the converter wrote, which is
    torch format) has no place for the amax histories and scales: the torch format refused it ('not
    in this model: ...gemm.amax_history; match the model flags') while torch_dist left them out. Both
    now resume the same weights and give the same losses."""
    runs = {}
    for fmt in ("torch", "torch_dist"):
        save = str(tmp_path / fmt)
        pretrain_gpt.main(_argv(save, 8, FP8 + ["--exit-interval", "4", "--ckpt-format", fmt]))
        if fmt == "torch_dist":  # the amax histories and scales are saved pieces with a CRC-32 each
            index = read_index(os.path.join(save, "iter_0000004"))
            fp8 = [key for (_, name), boxes in index.items() if is_fp8_state_key(name) for *_, key in boxes]
            assert fp8 and all(key in index.checksums for key in fp8)
        runs[fmt] = pretrain_gpt.main(_argv(str(tmp_path / f"{fmt}_bf16"), 8, ["--bf16", "--load", save,
                                                                              "--ckpt-format", fmt]))
        assert runs[fmt].iteration == 8
    assert_same_trajectory(Trajectory.of(runs["torch"]), Trajectory.of(runs["torch_dist"]), rtol=0, steps=4)


def test_fp8_switched_on_at_resume_starts_its_scaling_fresh(tmp_path):
    """--fp8-format on a resume from a checkpoint saved without it: the checkpoint has no amax
    histories or scales, which was refused ('missing in checkpoint: ...gemm.amax_history', torch_dist
    'has no weight for ...') without naming the flag. The scaling starts over, as in a new FP8 run:
    both formats give the same steps, within FP8's 3% of the bf16 continuation, and learn scales."""
    runs = {}
    for fmt in ("torch", "torch_dist"):
        save = str(tmp_path / fmt)
        pretrain_gpt.main(_argv(save, 8, ["--bf16", "--exit-interval", "4", "--ckpt-format", fmt]))
        runs[fmt] = pretrain_gpt.main(_argv(str(tmp_path / f"{fmt}_fp8"), 8, FP8 + ["--load", save, "--ckpt-format", fmt]))
        assert runs[fmt].iteration == 8
    assert_same_trajectory(Trajectory.of(runs["torch"]), Trajectory.of(runs["torch_dist"]), rtol=0, steps=4)
    bf16 = pretrain_gpt.main(_argv(str(tmp_path / "bf16"), 8, ["--bf16", "--load", str(tmp_path / "torch")]))
    for got, want in zip(runs["torch"].losses, bf16.losses, strict=True):
        assert abs(got - want) <= 0.03 * want, (runs["torch"].losses, bf16.losses)
    (scales,) = _saved_scales(str(tmp_path / "torch_fp8")).values()
    assert len(scales) == 16 and all(not torch.equal(s, torch.ones(3)) for s in scales.values())


def test_startup_log_names_the_fp8_path(tmp_path, capsys):
    pretrain_gpt.main(_argv(str(tmp_path / "log"), 3, FP8 + ["--first-last-layers-bf16"]))
    out = capsys.readouterr().out
    assert "FP8 hybrid (E4M3 forward, E5M2 gradients), delayed scaling" in out
    assert "FP8 layers 2-3 of 4" in out
    assert "GEMMs on cpu (decided by device: torch._scaled_mm is emulated there) as exact" in out
    assert "dequantised GEMMs with fp32 accumulation" in out and "chosen by a one-time probe" in out


def test_router_padding_for_fp8_trains_as_without_it(tmp_path):
    """--moe-router-padding-for-fp8 through the CLI (bf16, tensorwise, 4 steps of 4 micro-batches): the
    padding rows are zero with weight 0, so losses and gradient norms equal the unpadded run's."""
    moe = FP8 + ["--fp8-recipe", "tensorwise", "--num-experts", "4", "--moe-grouped-gemm",
                 "--moe-token-dispatcher-type", "alltoall"]
    plain, _ = _single(tmp_path, "plain", 4, moe)
    padded, _ = _single(tmp_path, "padded", 4, moe + ["--moe-router-padding-for-fp8"])
    assert_same_trajectory(padded, plain, rtol=1e-6, what="padded")


@pytest.mark.parametrize("flags, words", [
    (["--fp8-format", "hybrid"], ["--fp8-format", "--bf16"]),
    (["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "nvfp4"], ["--fp8-recipe", "nvfp4"]),
    pytest.param(["--bf16", "--fp8-format", "hybrid", "--transformer-impl", "transformer_engine"],
                 ["--transformer-impl transformer_engine", "use --transformer-impl local"],
                 marks=pytest.mark.skipif(not transformer_engine_missing(), reason="Transformer Engine and a GPU present")),
    (["--bf16", "--fp8-format", "hybrid", "--first-last-layers-bf16", "--num-layers-at-start-in-bf16", "3",
      "--num-layers-at-end-in-bf16", "2"], ["--num-layers-at-start-in-bf16"]),
    (["--bf16", "--num-experts", "4", "--moe-router-padding-for-fp8"], ["--moe-router-padding-for-fp8", "needs FP8"]),
    (["--bf16", "--fp8-format", "hybrid", "--moe-router-padding-for-fp8"], ["--moe-router-padding-for-fp8", "--num-experts"]),
    (["--bf16", "--fp8-format", "hybrid", "--num-experts", "4", "--moe-router-padding-for-fp8"],
     ["--moe-router-padding-for-fp8", "--moe-token-dispatcher-type alltoall"]),
])
def test_bad_fp8_flags_exit_2_with_one_line(capsys, flags, words):
    _one_line_exit_2(capsys, MODEL + ["--micro-batch-size", "2"] + flags, *words)


def test_transformer_engine_impl_through_the_cli(tmp_path, monkeypatch, capsys):
    calls = fake_te.install(monkeypatch)
    ref = run_script("pretrain_gpt", _argv(str(tmp_path / "local"), 4, ["--bf16"]))
    te = ["--transformer-impl", "transformer_engine", "--fp8-margin", "2", "--fp8-amax-history-len", "8",
          "--fp8-amax-compute-algo", "max", "--first-last-layers-bf16"]
    got = run_script("pretrain_gpt", _argv(str(tmp_path / "te"), 4, FP8 + te))
    assert "GEMMs through Transformer Engine" in capsys.readouterr().out
    assert_same_trajectory(got, ref, rtol=2e-2, grad_rtol=TE_GRAD_RTOL, steps=4, what="TE stand-in vs local bf16")
    # 4 steps x 4 micro-batches x 4 layers x (qkv, proj, fc1, fc2); layers 2-3 in FP8
    assert len(calls) == 4 * 4 * 4 * 4 and sum(c["enabled"] for c in calls) == len(calls) // 2
    want = fake_te.DelayedScaling(margin=2, fp8_format=fake_te.Format.HYBRID, amax_history_len=8,
                                  amax_compute_algo="max")
    assert all(c["recipe"] == want for c in calls if c["enabled"])
