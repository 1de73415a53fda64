"""The model-family flags together through pretrain_gpt.py (--add-qkv-bias, --rotary-percent,
--apply-layernorm-1p, --use-rope-scaling, --rotary-seq-len-interpolation-factor, --qk-layernorm,
--softmax-type learnable, and the attention flags --rotary-interleaved, --softmax-scale, --attention-output-gate,
--no-rope-freq on the rope + RMSNorm + SwiGLU + GQA model): TP2 + sequence parallelism follows the single-process trajectory
(losses and gradient norms, relative 1e-6), and its torch_dist checkpoint resumes in one process on the
same trajectory (the QKV bias, the zero-centred norms, the q/k norms and the per-head sinks resharded) to the same final
weights (every tensor within 1e-6 relative + 1e-6, the q/k norm weights, whose TP2 gradients are sums
over the ranks' heads, included). A gpt-oss-shaped model (learnable sinks, sliding windows in alternate
layers, the clamped GEGLU, QKV bias, grouped-GEMM experts; with the four attention flags) at EP2 x TP2 + SP and
CP2 x EP2 follows its single-process trajectory (relative 1e-5)."""

from megatron_lite.checkpoint import merge_checkpoint
from tests.e2e.test_pretrain_gpt import MODEL_B, _argv
from tests.trajectory import (
    assert_same_trajectory,
    assert_same_weights,
    ranks_trajectories,
    ranks_trajectory,
    run_script,
)

# models/attention_config.py: adjacent rotary pairs, a scale of its own, the gate heads in linear_qkv, layers 2 and 4 NoPE
ATTENTION = ["--rotary-interleaved", "--softmax-scale", "0.3", "--attention-output-gate", "--no-rope-freq", "2"]
# head size 8: 4 rotary channels; base 500000 so that Llama 3.1's scaling changes some frequencies
FAMILY = ATTENTION + MODEL_B + ["--add-qkv-bias", "--rotary-percent", "0.5", "--apply-layernorm-1p", "--use-rope-scaling",
                    "--rotary-base", "500000", "--rotary-seq-len-interpolation-factor", "2", "--qk-layernorm",
                    "--softmax-type", "learnable"]
DIST = ["--ckpt-format", "torch_dist"]


def test_family_flags_at_tp2_resume_from_torch_dist_in_one_process(tmp_path):
    single = run_script("pretrain_gpt", _argv(str(tmp_path / "single"), 4, FAMILY))
    src = str(tmp_path / "src")
    tp2 = ranks_trajectory(2, "pretrain_gpt", _argv(src, 4, FAMILY + DIST + [
        "--tensor-model-parallel-size", "2", "--sequence-parallel", "--exit-interval", "2"]))
    assert_same_trajectory(tp2, single[:2], rtol=1e-6, what="TP2 + SP")
    weights = merge_checkpoint(src)[0]
    assert "decoder.layers.0.self_attention.linear_qkv.bias" in weights
    assert weights["decoder.layers.0.self_attention.linear_qkv.weight"].shape == ((4 * 2 + 2 * 2) * 8, 32)  # + 4 gates
    assert "decoder.layers.0.self_attention.linear_proj.bias" not in weights
    assert weights["decoder.layers.1.self_attention.k_layernorm.weight"].shape == (8,)  # one head's channels
    sinks = weights["decoder.layers.1.self_attention.core_attention.softmax_offset"]
    assert sinks.shape == (4,) and sinks.abs().min() > 0  # one per head (two per TP rank), trained from 0
    resumed = run_script("pretrain_gpt", _argv(str(tmp_path / "tp1"), 4, FAMILY + DIST + ["--load", src,
                                                                                       "--no-load-rng"]))
    assert_same_trajectory(resumed, single[2:], rtol=1e-6, what="resumed at TP1")
    assert_same_weights(str(tmp_path / "tp1"), str(tmp_path / "single"), rtol=1e-6, atol=1e-6, what="TP2 + SP, resumed")


# gpt-oss's parts on MODEL_B's rope + RMSNorm + GQA model (its gated activation instead of SwiGLU)
GPT_OSS = ATTENTION + [f for f in MODEL_B if f != "--swiglu"] + [
    "--quick-geglu", "--softmax-type", "learnable", "--window-size", "4", "0", "--window-attn-skip-freq", "2",
    "--add-qkv-bias", "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
    "--moe-aux-loss-coeff", "1e-2", "--moe-token-dispatcher-type", "alltoall", "--moe-grouped-gemm"]


def test_gpt_oss_shape_at_ep2_tp2_sp_and_cp2_ep2_follows_one_process(tmp_path):
    """The sinks' gradients summed over CP, the windows cut per CP chunk, the experts' gated activation
    split over EP (and TP at ETP 2): each layout's losses and gradient norms are the single process's."""
    iters = 4  # the 2 warm-up steps and 2 more: the 4th loss is below the first (6 steps took half as long again)
    single = run_script("pretrain_gpt", _argv(str(tmp_path / "single"), iters, GPT_OSS))
    ep2 = ["--expert-model-parallel-size", "2"]
    layouts = {"ep2_tp2_sp": ep2 + ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
               "cp2_ep2": ep2 + ["--context-parallel-size", "2"]}
    runs = ranks_trajectories(4, "pretrain_gpt", [_argv(str(tmp_path / n), iters, GPT_OSS + f)
                                                for n, f in layouts.items()])
    for name, got in zip(layouts, runs):
        assert_same_trajectory(got, single, what=name)
    assert single.losses[-1] < single.losses[0]
