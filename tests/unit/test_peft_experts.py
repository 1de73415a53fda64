"""The mixtral, qwen3_moe and gpt_oss PEFT exports' layouts without a training run (the logits against
transformers + peft are tests/e2e/test_lora_export.py): the fused QKV adapter split into q/k/v,
routed experts' adapters (sequential and grouped) stacked as PEFT's ParamWrapper reads them (gpt-oss's
transposed, gate/up-interleaved gate_up_proj too), Qwen3-MoE's dense layers targeted by parameter; what
has no export refused in one line naming the fix (all were refused: 'the experts' LoRA adapters have no
PEFT export here', gpt_oss 'supports the ... styles, not gpt_oss')."""

import pytest
import torch

from megatron_lite.checkpoint.format import CheckpointError
from megatron_lite.checkpoint.hf import qkv_to_separate
from megatron_lite.checkpoint.hf_gptoss import deinterleave
from megatron_lite.errors import ConfigError
from megatron_lite.lora.peft_export import peft_adapter

R, H, FFN, E, HEADS, GROUPS = 2, 8, 6, 3, 4, 2
QKV_ROWS = H + 2 * GROUPS * (H // HEADS)
CFG = dict(num_layers=2, hidden_size=H, num_attention_heads=HEADS, num_query_groups=GROUPS, num_experts=E,
           lora_rank=R, lora_alpha=4, lora_dropout=0.1)
GEN = torch.Generator().manual_seed(0)
# a model the gpt_oss format expresses (hf_gptoss.check_gptoss)
GPT_OSS = dict(CFG, quick_geglu=True, glu_linear_offset=1.0, activation_func_clamp_value=7.0, softmax_type="learnable",
               position_embedding_type="rope", normalization="RMSNorm")


def _pair(prefix, rows, cols):
    return {prefix + "adapter.linear_in.weight": torch.randn(R, cols, generator=GEN),
            prefix + "adapter.linear_out.weight": torch.randn(rows, R, generator=GEN)}


def _sequential(layer):
    out = {}
    for j in range(E):
        out.update(_pair(f"decoder.layers.{layer}.mlp.experts.local_experts.{j}.linear_fc1.", 2 * FFN, H))
        out.update(_pair(f"decoder.layers.{layer}.mlp.experts.local_experts.{j}.linear_fc2.", H, FFN))
    return out


def _grouped(layer):
    """Grouped experts' adapters: the sequential ones stacked and transposed ([E, in, r], [E, r, out])."""
    seq, out = _sequential(layer), {}
    for fc in (1, 2):
        for w in ("in", "out"):
            out[f"decoder.layers.{layer}.mlp.experts.linear_fc{fc}_adapter.linear_{w}.weight"] = torch.stack(
                [seq[f"decoder.layers.{layer}.mlp.experts.local_experts.{j}.linear_fc{fc}.adapter.linear_{w}.weight"].t()
                 for j in range(E)])
    return seq, out


def _attention(layer):
    return {**_pair(f"decoder.layers.{layer}.self_attention.linear_qkv.", QKV_ROWS, H),
            **_pair(f"decoder.layers.{layer}.self_attention.linear_proj.", H, H)}


def check_experts(tensors, seq, layer):
    stem = f"base_model.model.model.layers.{layer}.mlp.experts."
    for module, fc in (("base_layer.", 1), ("", 2)):  # gate_up_proj wrapped first: the inner module
        a, b = tensors[f"{stem}{module}lora_A.weight"], tensors[f"{stem}{module}lora_B.weight"]
        # PEFT's ParamWrapper.get_delta_weight for [E, out, in] parameters
        delta = torch.einsum("ore,eri->eoi", b.reshape(b.shape[0], R, E), a.reshape(E, R, -1))
        for j in range(E):
            p = f"decoder.layers.{layer}.mlp.experts.local_experts.{j}.linear_fc{fc}.adapter.linear_"
            torch.testing.assert_close(delta[j], seq[p + "out.weight"] @ seq[p + "in.weight"])


def test_qwen3_moe_experts_stacked_and_dense_layer_by_parameter():
    adapters = {**_attention(0), **_sequential(0), **_pair("decoder.layers.1.mlp.linear_fc1.", 2 * FFN, H),
                **_pair("decoder.layers.1.mlp.linear_fc2.", H, FFN)}
    config, tensors = peft_adapter({**CFG, "moe_layer_freq": "[1,0]"}, adapters, "qwen3_moe", "/base")
    assert config["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert config["target_parameters"] == ["mlp.down_proj.weight", "mlp.experts.down_proj", "mlp.experts.gate_up_proj",
                                           "mlp.gate_proj.weight", "mlp.up_proj.weight"]
    assert config["lora_dropout"] == 0.0  # PEFT's parameter adapters take no dropout
    check_experts(tensors, adapters, 0)
    qkv_b = adapters["decoder.layers.0.self_attention.linear_qkv.adapter.linear_out.weight"]
    for name, want in zip(("q_proj", "k_proj", "v_proj"), qkv_to_separate(qkv_b, HEADS, GROUPS, H // HEADS)):
        assert torch.equal(tensors[f"base_model.model.model.layers.0.self_attn.{name}.lora_B.weight"], want)
    up = tensors["base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"]
    assert torch.equal(up, adapters["decoder.layers.1.mlp.linear_fc1.adapter.linear_out.weight"][FFN:])


def test_mixtral_grouped_experts_as_the_sequential_ones():
    seq, grouped = _grouped(0)
    seq1, grouped1 = _grouped(1)
    _, tensors = peft_adapter(CFG, {**grouped, **grouped1}, "mixtral", "/base")
    _, want = peft_adapter(CFG, {**seq, **seq1}, "mixtral", "/base")
    assert tensors.keys() == want.keys()
    assert all(torch.equal(tensors[k], want[k]) for k in want)
    check_experts(tensors, seq1, 1)


def test_one_expert_fc_alone_sits_on_the_experts_module():
    fc2 = {k: v for k, v in _sequential(0).items() if "linear_fc2" in k}
    cfg = {**CFG, "num_layers": 1}
    config, tensors = peft_adapter(cfg, fc2, "mixtral", "/base")
    assert config["target_parameters"] == ["mlp.experts.down_proj"] and config["target_modules"] == []
    assert sorted(tensors) == ["base_model.model.model.layers.0.mlp.experts.lora_A.weight",
                               "base_model.model.model.layers.0.mlp.experts.lora_B.weight"]


def test_what_has_no_export_is_refused_naming_the_fix():
    partial = {k: v for k, v in _sequential(0).items() if ".local_experts.0." not in k}  # expert 0 without adapters
    with pytest.raises(CheckpointError, match=r"^adapter decoder\.layers\.0\.mlp\.experts\.local_experts\.1\.linear_fc1"
                                              r"\.adapter\.linear_in\.weight has no counterpart in the mixtral PEFT export "
                                              r"\(transformers' MixtralForCausalLM has no such module\); pass --merge-lora$"):
        peft_adapter({**CFG, "num_layers": 1}, partial, "mixtral", "/base")
    with pytest.raises(CheckpointError, match=r"^the llama format has no experts for the experts' LoRA adapters; use "
                                              r"--hf-style mixtral$"):
        peft_adapter(CFG, _sequential(0), "llama", "/base")
    with pytest.raises(CheckpointError, match=r"^PEFT export of LoRA adapters supports the .* styles, not bert; "
                                              r"pass --merge-lora to export the merged model instead$"):
        peft_adapter(CFG, _sequential(0), "bert", "/base")


def test_gpt_oss_experts_transposed_with_gate_and_up_interleaved():
    """GptOssExperts: gate_up_proj [E, h, 2 ffn] with gate/up in alternating columns, down_proj [E, ffn, h],
    marked is_transposed, so PEFT adds (B_e A_e)^T; fc1's B rows must be interleaved like the columns
    (copied whole as for Mixtral, gate and up of every expert were mixed: 0.19 off in the e2e logits)."""
    seq, grouped = _grouped(0)
    adapters = {**_attention(0), **seq}
    config, tensors = peft_adapter({**GPT_OSS, "num_layers": 1}, adapters, "gpt_oss", "/base")
    assert config["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert config["target_parameters"] == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    stem = "base_model.model.model.layers.0.mlp.experts."
    for module, fc in (("base_layer.", 1), ("", 2)):
        a, b = tensors[f"{stem}{module}lora_A.weight"], tensors[f"{stem}{module}lora_B.weight"]
        # PEFT's ParamWrapper.get_delta_weight for is_transposed [E, in, out] parameters
        delta = torch.einsum("ore,eri->eio", b.reshape(b.shape[0], R, E), a.reshape(E, R, -1))
        for j in range(E):
            p = f"decoder.layers.0.mlp.experts.local_experts.{j}.linear_fc{fc}.adapter.linear_"
            want = (seq[p + "out.weight"] @ seq[p + "in.weight"]).t()  # x @ W: [in, out]
            torch.testing.assert_close(deinterleave(delta[j]) if fc == 1 else delta[j], want)
    _, from_grouped = peft_adapter({**GPT_OSS, "num_layers": 1}, grouped, "gpt_oss", "/base")
    assert all(torch.equal(from_grouped[k], tensors[k]) for k in from_grouped) and len(from_grouped) == 4


def test_gpt_oss_refusals_name_the_base_format_and_the_style():
    with pytest.raises(ConfigError, match=r"^the gpt_oss format cannot express this model: its experts' MLP is "
                                          r"--quick-geglu"):
        peft_adapter({**GPT_OSS, "quick_geglu": False, "swiglu": True}, _sequential(0), "gpt_oss", "/base")
    with pytest.raises(ConfigError, match=r"^--moe-layer-freq '\[1,0\]' \(dense layers\) cannot be expressed in the "
                                          r"gpt_oss format"):
        peft_adapter({**GPT_OSS, "moe_layer_freq": "[1,0]"}, _sequential(0), "gpt_oss", "/base")
    with pytest.raises(CheckpointError, match=r"^the llama format has no experts for the experts' LoRA adapters; use "
                                              r"--hf-style gpt_oss$"):
        peft_adapter(GPT_OSS, _sequential(0), "llama", "/base")
