"""LoRA end to end through pretrain_gpt.py: parallel runs reproduce one process, the base stays
bit-identical, checkpoints hold the adapters plus a base reference and resume exactly.

Each base model (dense GPT; MoE with sequential or grouped experts) is pretrained for 2 steps and
saved once; every LoRA run starts from it with --pretrained-checkpoint. The single-process LoRA run
of each model is the reference (module fixtures); TP2 + SP, TP2 x PP2 + SP, PP2 (1F1B, ZB-H1), CP2 with full
recompute, DP2 with the distributed optimizer and DP2 ZeRO-3 (dense), EP2 and TP2 + SP with the
experts split over TP or whole on every TP rank (experts with adapters) must give its losses and
gradient norms within rel 1e-5.
"""

import os
import re
import shutil

import pytest
import torch

import pretrain_gpt
from megatron_lite.checkpoint import merge_checkpoint
from megatron_lite.lora.apply import is_adapter_name
from tests.e2e.test_pretrain_gpt import _one_line_exit_2
from tests.harness import run_ranks
from tests.trajectory import Trajectory, assert_same_trajectory, ranks_trajectory, run_script

ITERS = 5  # past the 2 warm-up steps (was 6: one step fewer in every run of the file)
COMMON = ["--mock-data", "--vocab-size", "64", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
          "--seq-length", "16", "--make-vocab-size-divisible-by", "16", "--micro-batch-size", "2",
          "--global-batch-size", "4", "--lr", "1e-2", "--eval-iters", "0", "--log-interval", "1",
          "--attention-dropout", "0", "--hidden-dropout", "0"]
MODELS = {
    "dense": [],
    "moe": ["--num-experts", "4", "--moe-ffn-hidden-size", "32", "--swiglu", "--disable-bias-linear"],
    "moe_grouped": ["--num-experts", "4", "--moe-ffn-hidden-size", "32", "--swiglu", "--disable-bias-linear",
                    "--moe-grouped-gemm"],
}
# multi-latent attention with q compression; its adapters sit on the up-projections and the output projection
MODELS["mla"] = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
                 "--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "8", "--qk-head-dim", "8",
                 "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6"]
LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--train-iters", str(ITERS)]
# FP8 LoRA at TP2 + SP vs one process, measured: losses 1.8e-4, adapter gradient norms 2.2e-2 (bf16
# adapters alone, without FP8: 1.5e-2; the adapters' gradients are small bf16 sums in another order)
FP8_TP_RTOL, FP8_TP_GRAD_RTOL = 1e-3, 5e-2
TARGETS = {"mla": ["--lora-target-modules", "linear_q_up_proj", "linear_kv_up_proj", "linear_proj", "linear_fc1",
                   "linear_fc2"]}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_bases")
    out = {}
    for name, flags in MODELS.items():
        out[name] = str(root / name)
        pretrain_gpt.main(COMMON + flags + ["--train-iters", "2", "--save", out[name]])
    return out


def lora_argv(bases, model, extra=()):
    return COMMON + MODELS[model] + LORA + TARGETS.get(model, []) + ["--pretrained-checkpoint", bases[model], *extra]


@pytest.fixture(scope="module")
def references(bases):
    return {model: run_script("pretrain_gpt", lora_argv(bases, model)) for model in MODELS}


@pytest.mark.parametrize("name, model, extra", [
    ("tp2_sp", "dense", ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    ("pp2", "dense", ["--pipeline-model-parallel-size", "2"]),
    ("pp2_zero_bubble", "dense", ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1",
                                  "--micro-batch-size", "1"]),
    ("cp2_full_recompute", "dense", ["--context-parallel-size", "2", "--recompute-granularity", "full",
                                     "--recompute-method", "uniform"]),
    ("dp2_distributed_optimizer", "dense", ["--use-distributed-optimizer"]),
    ("dp2_zero3", "dense", ["--data-parallel-sharding-strategy", "optim_grads_params"]),
    ("ep2_sequential_experts", "moe", ["--expert-model-parallel-size", "2"]),
    ("ep2_grouped_experts", "moe_grouped", ["--expert-model-parallel-size", "2"]),
    ("tp2_sp_expert_tensor_parallel", "moe_grouped", ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    ("tp2_sp_whole_experts", "moe", ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                     "--expert-tensor-parallel-size", "1"]),
    # parallel folding: TP 1 attention, every expert (and its adapters) split over ETP 2; the base is cut
    # from the merged one-process weights (--pretrained-checkpoint on a folded grid)
    ("etp2_folded_experts", "moe", ["--expert-tensor-parallel-size", "2"]),
    ("etp2_folded_grouped_experts", "moe_grouped", ["--expert-tensor-parallel-size", "2"]),
    ("mla_tp2_sp", "mla", ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    ("mla_cp2", "mla", ["--context-parallel-size", "2"]),
])
def test_parallel_lora_reproduces_one_process(bases, references, name, model, extra):
    got = ranks_trajectory(2, "pretrain_gpt", lora_argv(bases, model, extra))
    assert_same_trajectory(got, references[model], what=name)


def test_lora_tp2_pp2_sp_reproduces_one_process(bases, references):
    """TP and PP together (4 ranks): each stage's adapters split over its TP ranks, the frozen base
    cut from the one-process checkpoint for both stages."""
    extra = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "2"]
    got = ranks_trajectory(4, "pretrain_gpt", lora_argv(bases, "dense", extra))
    assert_same_trajectory(got, references["dense"], what="tp2_pp2_sp")


def test_first_step_is_the_base_model_and_the_adapters_then_change_it(bases, references):
    """With B = 0 the first step's loss is exactly the base model's (a full fine-tune from the same
    base, without adapters, on the same batch); after the first update the losses differ."""
    full = run_script("pretrain_gpt", COMMON + ["--train-iters", str(ITERS), "--pretrained-checkpoint", bases["dense"]])
    ref = references["dense"]
    assert full.losses[0] == ref.losses[0]
    assert all(a != b for a, b in zip(full.losses[1:], ref.losses[1:]))


def _frozen_equal_base(result, base_folder):
    """Every frozen parameter of the trained (single-process) model is bit-identical to the base's."""
    base = merge_checkpoint(base_folder)[0]
    frozen = [(n, p) for n, p in result.chunks[0].module.named_parameters() if not p.requires_grad]
    assert frozen
    for name, param in frozen:
        want = base[name]
        assert torch.equal(param.detach(), want[: param.shape[0]] if name.startswith("embedding.word") else want), name


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_checkpoint_holds_adapters_and_resumes_exactly(tmp_path, capsys, bases, references, fmt):
    run = str(tmp_path / "run")
    first = run_script("pretrain_gpt", lora_argv(bases, "dense", ["--save", run, "--exit-interval", "3",
                                                                 "--ckpt-format", fmt]))
    saved, config = merge_checkpoint(run)
    assert saved and all(is_adapter_name(k) for k in saved)  # no base weight is written
    assert config["lora_rank"] == 4
    capsys.readouterr()
    argv = COMMON + MODELS["dense"] + LORA + ["--load", run, "--ckpt-format", fmt]
    result = pretrain_gpt.main(argv)
    assert f"loading the frozen base weights from {bases['dense']}" in capsys.readouterr().out
    second = Trajectory.of(result)
    joined = Trajectory(first.losses + second.losses, first.grad_norms + second.grad_norms,
                        first.reported + second.reported)
    assert_same_trajectory(joined, references["dense"], what=f"resume {fmt}")
    _frozen_equal_base(result, bases["dense"])


def test_fp8_base_gemms_with_bf16_adapters(bases, references):
    """The frozen base's GEMMs in FP8, the adapters in bf16: the losses stay within FP8 rounding of the
    fp32 run, and TP2 + SP (amaxes reduced over TP, adapters sharded) reproduces one process."""
    fp8 = ["--bf16", "--fp8-format", "hybrid"]
    single = run_script("pretrain_gpt", lora_argv(bases, "dense", fp8))
    for step, (got, want) in enumerate(zip(single.losses, references["dense"].losses, strict=True), 1):
        assert abs(got - want) <= 2e-3 * abs(want), f"step {step}: FP8 loss {got} vs fp32 {want}"
    tp2 = ranks_trajectory(2, "pretrain_gpt", lora_argv(bases, "dense", fp8 + ["--tensor-model-parallel-size", "2",
                                                                              "--sequence-parallel"]))
    assert_same_trajectory(tp2, single, rtol=FP8_TP_RTOL, grad_rtol=FP8_TP_GRAD_RTOL, what="FP8 LoRA TP2 + SP")


def test_mla_projections_carry_the_adapters_asked_for(tmp_path, bases):
    """Each MLA target of each layer gets an adapter (the down-projections and norms stay frozen as asked)."""
    run = str(tmp_path / "run")
    result = pretrain_gpt.main(lora_argv(bases, "mla", ["--save", run, "--exit-interval", "1"]))
    adapted = {name.split(".adapter.")[0].split(".")[-1] + "@" + re.search(r"layers\.(\d+)\.", name)[1]
               for name in merge_checkpoint(run)[0]}
    wanted = set(TARGETS["mla"][1:])
    assert adapted == {f"{t}@{layer}" for t in wanted for layer in ("0", "1")}, sorted(adapted)
    _frozen_equal_base(result, bases["mla"])


def test_ep2_grouped_expert_adapters_resume_exactly_from_torch_dist(tmp_path, bases, references):
    """Each EP rank saves its experts' stacked adapters under their global expert rows."""
    run = str(tmp_path / "run")
    ep2 = ["--expert-model-parallel-size", "2", "--ckpt-format", "torch_dist"]
    first = ranks_trajectory(2, "pretrain_gpt", lora_argv(bases, "moe_grouped", ep2 + ["--save", run,
                                                                                   "--exit-interval", "3"]))
    second = ranks_trajectory(2, "pretrain_gpt", COMMON + MODELS["moe_grouped"] + LORA + ep2 + ["--load", run])
    joined = Trajectory(first.losses + second.losses, first.grad_norms + second.grad_norms,
                        first.reported + second.reported)
    assert_same_trajectory(joined, references["moe_grouped"], what="EP2 resume")


def test_resume_refuses_a_base_that_is_gone_or_changed(tmp_path, capsys, bases):
    base, run = str(tmp_path / "base"), str(tmp_path / "run")
    shutil.copytree(bases["dense"], base)
    pretrain_gpt.main(COMMON + LORA[:4] + ["--train-iters", "1", "--pretrained-checkpoint", base, "--save", run])
    resume = COMMON + LORA[:4] + ["--train-iters", "2", "--load", run]
    other = str(tmp_path / "other")
    pretrain_gpt.main(COMMON + ["--train-iters", "3", "--lr", "5e-3", "--save", other])
    _one_line_exit_2(capsys, resume + ["--pretrained-checkpoint", other], "is not the base checkpoint")
    folder = os.path.join(base, "iter_0000002")
    shutil.rmtree(folder)
    shutil.copytree(os.path.join(other, "iter_0000003"), folder)  # same shapes, other weights
    _one_line_exit_2(capsys, resume, "has changed since it was trained")
    shutil.rmtree(base)
    _one_line_exit_2(capsys, resume, "which is gone")


def test_a_lora_checkpoint_is_not_a_pretrained_model(tmp_path, capsys, bases):
    run = str(tmp_path / "run")
    pretrain_gpt.main(COMMON + LORA[:4] + ["--train-iters", "1", "--pretrained-checkpoint", bases["dense"], "--save", run])
    _one_line_exit_2(capsys, COMMON + ["--train-iters", "1", "--pretrained-checkpoint", run], "holds LoRA adapters only")
    _one_line_exit_2(capsys, COMMON + ["--train-iters", "1", "--load", run], "holds only the trained parameters")
    _one_line_exit_2(capsys, COMMON + LORA[:4] + ["--train-iters", "1", "--load", str(tmp_path / "empty")],
                     "LoRA needs the base model to adapt")


def _state_bytes(argv):
    """Inside a rank: one LoRA step; (frozen, trainable, measured bytes by kind) of this rank."""
    from megatron_lite.perf.model_state import measured_model_state_bytes

    result = pretrain_gpt.main(argv)
    params = [p for c in result.chunks for p in c.parameters()]
    frozen = sum(p.numel() for p in params if not p.requires_grad)
    return frozen, sum(p.numel() for p in params) - frozen, measured_model_state_bytes(result.chunks, result.optimizer)


@pytest.mark.parametrize("strategy, world, dtype", [
    ("no_shard", 1, torch.float32), ("optim", 2, torch.float32), ("optim", 2, torch.bfloat16),
    ("optim_grads", 2, torch.float32), ("optim_grads_params", 2, torch.float32),
])
def test_gradients_and_optimizer_state_hold_only_the_adapters(bases, strategy, world, dtype):
    """Measured bytes per rank == frozen x P + adapters x the strategy's bytes (no padding here: every
    bucket's size is even); the gradient buffer and the optimizer hold the adapters and nothing else."""
    from megatron_lite.perf.model_state import model_state_bytes_split, model_state_bytes_with_frozen

    extra = ["--train-iters", "1", "--data-parallel-sharding-strategy", strategy]
    extra += ["--bf16"] if dtype == torch.bfloat16 else []
    argv = lora_argv(bases, "dense", extra)
    results = run_ranks(world, _state_bytes, argv) if world > 1 else [_state_bytes(argv)]
    for frozen, trainable, got in results:
        assert 0 < trainable < frozen
        weight = torch.empty((), dtype=dtype).element_size()
        device, _ = model_state_bytes_with_frozen(dtype, strategy, world, frozen=frozen, trainable=trainable)
        assert sum(got.values()) == device
        per = model_state_bytes_split(dtype, strategy, world)[0] - (weight / world if strategy == "optim_grads_params"
                                                                   else weight)
        assert got["grads"] + got["optimizer"] == per * trainable  # adapters only


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_resume_refuses_another_lora_alpha_naming_it(tmp_path, capsys, fmt):
    """--lora-alpha / --lora-rank scales every adapter: a resume with another alpha went on silently
    (the trained adapters rescaled, and a merge then used the alpha saved last). It is refused in one
    line naming the flag and both values, as are another rank and target list; --lora-dropout (not
    part of the saved model) may change."""
    base, run = str(tmp_path / "base"), str(tmp_path / "run")
    pretrain_gpt.main(COMMON + ["--train-iters", "1", "--save", base])
    pretrain_gpt.main(COMMON + LORA[:4] + ["--train-iters", "2", "--exit-interval", "1", "--pretrained-checkpoint",
                                           base, "--save", run, "--ckpt-format", fmt])
    resume = COMMON + ["--train-iters", "2", "--load", run, "--ckpt-format", fmt]
    _one_line_exit_2(capsys, resume + ["--lora-rank", "4", "--lora-alpha", "16"], "--lora-alpha 8.0 (this run 16.0)")
    _one_line_exit_2(capsys, resume + ["--lora-rank", "8", "--lora-alpha", "8"], "--lora-rank 4 (this run 8)")
    _one_line_exit_2(capsys, resume + LORA[:4] + ["--lora-target-modules", "linear_qkv,linear_fc1"],
                     "--lora-target-modules linear_qkv linear_proj linear_fc1 linear_fc2 (this run linear_qkv linear_fc1)")
    assert pretrain_gpt.main(resume + LORA[:4] + ["--lora-dropout", "0.1"]).iteration == 2
