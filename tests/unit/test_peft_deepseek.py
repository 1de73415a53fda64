"""The deepseek_v3 PEFT export's layouts without a training run (the logits against transformers +
peft are tests/e2e/test_lora_export.py): routed experts' adapters stacked as PEFT's ParamWrapper reads
them, the dense MLP and shared experts targeted by parameter, and an adapter without an HF counterpart
refused in one line naming it."""

import pytest
import torch

from megatron_lite.checkpoint.format import CheckpointError
from megatron_lite.lora.peft_export import peft_adapter
from tests.unit.test_peft_experts import E as EXPERTS_E
from tests.unit.test_peft_experts import R as EXPERTS_R
from tests.unit.test_peft_experts import check_experts

R, H, FFN, E = 2, 8, 6, 3
assert (R, E) == (EXPERTS_R, EXPERTS_E)  # check_experts reads test_peft_experts.py's rank and expert count
CFG = dict(num_layers=2, num_experts=E, moe_layer_freq="[0,1]", lora_rank=R, lora_alpha=4, lora_dropout=0.1)
GEN = torch.Generator().manual_seed(0)


def _pair(prefix, rows, cols):
    return {prefix + "adapter.linear_in.weight": torch.randn(R, cols, generator=GEN),
            prefix + "adapter.linear_out.weight": torch.randn(rows, R, generator=GEN)}


def _adapters():
    out = {}
    out.update(_pair("decoder.layers.0.self_attention.linear_proj.", H, 12))
    out.update(_pair("decoder.layers.0.mlp.linear_fc1.", 2 * FFN, H))
    out.update(_pair("decoder.layers.1.mlp.shared_experts.linear_fc2.", H, FFN))
    for j in range(E):
        out.update(_pair(f"decoder.layers.1.mlp.experts.local_experts.{j}.linear_fc1.", 2 * FFN, H))
        out.update(_pair(f"decoder.layers.1.mlp.experts.local_experts.{j}.linear_fc2.", H, FFN))
    return out


def test_experts_are_stacked_as_peft_reads_them():
    adapters = _adapters()
    config, tensors = peft_adapter(CFG, adapters, "deepseek_v3", "/base")
    assert config["target_modules"] == ["o_proj"]
    assert config["target_parameters"] == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj", "mlp.gate_proj.weight",
                                           "mlp.shared_experts.down_proj.weight", "mlp.up_proj.weight"]
    assert config["lora_dropout"] == 0.0  # PEFT's parameter adapters take no dropout
    check_experts(tensors, adapters, 1)  # PEFT's stacked-expert layout (the same R and E)
    gate = tensors["base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight"]
    assert torch.equal(gate, adapters["decoder.layers.0.mlp.linear_fc1.adapter.linear_out.weight"][:FFN])


def test_an_adapter_without_counterpart_is_refused_naming_it():
    adapters = {**_adapters(), **_pair("mtp.layers.0.transformer_layer.self_attention.linear_proj.", H, 12)}
    with pytest.raises(CheckpointError, match=r"^adapter mtp\.layers\.0\.transformer_layer\.self_attention\."
                                              r"linear_proj\.adapter\.linear_in\.weight has no counterpart .*does not run the "
                                              r"multi-token prediction layers\); pass --merge-lora$"):
        peft_adapter(CFG, adapters, "deepseek_v3", "/base")
