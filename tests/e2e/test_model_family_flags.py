"""The model-family flags together through pretrain_gpt.py (--add-qkv-bias, --rotary-percent,
--apply-layernorm-1p, --use-rope-scaling, --rotary-seq-len-interpolation-factor, --qk-layernorm,
--softmax-type learnable on the rope + RMSNorm + SwiGLU + GQA model): TP2 + sequence parallelism follows the single-process trajectory
(losses and gradient norms, relative 1e-6), and its torch_dist checkpoint resumes in one process on the
same trajectory (the QKV bias, the zero-centred norms, the q/k norms and the per-head sinks resharded) to the same final
weights (every tensor within 1e-6 relative + 1e-6, the q/k norm weights, whose TP2 gradients are sums
over the ranks' heads, included)."""

from megatron_lite.checkpoint import merge_checkpoint
from tests.e2e.test_pretrain_gpt import MODEL_B, _argv
from tests.trajectory import assert_same_trajectory, assert_same_weights, ranks_trajectory, run_script

# head size 8: 4 rotary channels; base 500000 so that Llama 3.1's scaling changes some frequencies
FAMILY = MODEL_B + ["--add-qkv-bias", "--rotary-percent", "0.5", "--apply-layernorm-1p", "--use-rope-scaling",
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
    assert "decoder.layers.0.self_attention.linear_proj.bias" not in weights
    assert weights["decoder.layers.1.self_attention.k_layernorm.weight"].shape == (8,)  # one head's channels
    sinks = weights["decoder.layers.1.self_attention.core_attention.softmax_offset"]
    assert sinks.shape == (4,) and sinks.abs().min() > 0  # one per head (two per TP rank), trained from 0
    resumed = run_script("pretrain_gpt", _argv(str(tmp_path / "tp1"), 4, FAMILY + DIST + ["--load", src,
                                                                                       "--no-load-rng"]))
    assert_same_trajectory(resumed, single[2:], rtol=1e-6, what="resumed at TP1")
    assert_same_weights(str(tmp_path / "tp1"), str(tmp_path / "single"), rtol=1e-6, atol=1e-6, what="TP2 + SP, resumed")
