"""Each fusion flag's documented effect happens in the model: the fused path is really taken (the
``jit_fuser`` functions it goes through are counted) and computes what the unfused model computes."""

import dataclasses

import pytest
import torch

import megatron_lite.fusions.jit as jit
import megatron_lite.models.transformer as transformer
from megatron_lite.fusions import bias_dropout_add
from megatron_lite.models import TransformerConfig
from tests.model_helpers import FUSION_MODEL, loss_and_grads

MLA = dict(multi_latent_attention=True, kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6,
           position_embedding_type="rope")


@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_rope_and_bias_dropout_fusions_take_the_fused_path(monkeypatch, attention):
    """With --rope-fusion the rotary embedding runs through a jit_fuser function, and with
    --bias-dropout-fusion both output projections leave their bias to the fused residual (two calls
    with a bias per layer), for multi-latent attention as for plain attention; off, neither happens.
    The fused model computes what the unfused one computes."""
    calls = []
    call = jit._FusedFunction.__call__

    def spy(self, *args, **kwargs):
        calls.append((self.fn.__name__, None))
        return call(self, *args, **kwargs)

    def fused_residual(x, bias, *args):  # eagerly on a CPU it calls no jit_fuser function (its own eager route)
        calls.append(("bias_dropout_add", bias is not None))
        return bias_dropout_add(x, bias, *args)

    monkeypatch.setattr(jit._FusedFunction, "__call__", spy)
    monkeypatch.setattr(transformer, "bias_dropout_add", fused_residual)
    extra = {**FUSION_MODEL, **(MLA if attention == "mla" else {"position_embedding_type": "rope"}),
             "openai_gelu": True}
    unfused = TransformerConfig(**extra)
    loss, grads = loss_and_grads(unfused, wrap=False)
    assert calls == []
    fused = dataclasses.replace(unfused, bias_dropout_fusion=True, apply_rope_fusion=True)
    fused_loss, fused_grads = loss_and_grads(fused, wrap=False)
    rotary = "apply_mla_rotary" if attention == "mla" else "apply_rotary"
    assert sum(name == rotary for name, _ in calls) == 2 * FUSION_MODEL["num_layers"]  # queries and keys, every layer
    assert sum(name == "bias_dropout_add" and bias for name, bias in calls) == 2 * FUSION_MODEL["num_layers"]
    torch.testing.assert_close(fused_loss, loss, rtol=1e-5, atol=1e-6)
    for name in grads:
        torch.testing.assert_close(fused_grads[name], grads[name], rtol=1e-5, atol=1e-6, msg=name)
