"""PEFT adapter of a LoRA model exported in the ``deepseek_v3`` style (multi-latent attention, dense
layers then MoE layers), for transformers' ``DeepseekV3ForCausalLM`` (:mod:`megatron_lite.checkpoint.hf_deepseek`).

Attention (PEFT ``target_modules``, one-to-one like the base weights): ``linear_q_proj`` -> ``q_proj``,
``linear_q_up_proj`` -> ``q_b_proj``, ``linear_kv_up_proj`` -> ``kv_b_proj``, ``linear_proj`` -> ``o_proj``.

MLP (PEFT ``target_parameters``): the routed experts on transformers' stacked experts, the dense MLPs
and the shared experts by parameter (``mlp.gate_proj.weight`` ...), as :mod:`.peft_experts` says.
"""

from __future__ import annotations

from .peft_experts import Taken, experts, swiglu

ATTENTION = (("linear_q_proj", "q_proj"), ("linear_q_up_proj", "q_b_proj"), ("linear_kv_up_proj", "kv_b_proj"),
             ("linear_proj", "o_proj"))


def deepseek_modules(cfg: dict, adapters: dict) -> tuple[dict, list, list]:
    """({HF module name: (lora_A, lora_B)}, target_modules, target_parameters) of single-process ``adapters``."""
    from ..checkpoint.hf_deepseek import _layer_pattern

    pattern, _ = _layer_pattern(cfg)
    num_experts, taken = int(cfg.get("num_experts") or 0), Taken(adapters)
    out, modules, params = {}, set(), set()
    for i in range(cfg["num_layers"]):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        for ours, theirs in ATTENTION:
            if (pair := taken.pair(f"{src}self_attention.{ours}.")) is not None:
                out[f"{dst}self_attn.{theirs}"] = pair
                modules.add(theirs)
        if pattern[i]:
            swiglu(out, params, taken, src + "mlp.shared_experts.", dst + "mlp.shared_experts.")
            experts(out, params, taken, src, dst, num_experts)
        else:
            swiglu(out, params, taken, src + "mlp.", dst + "mlp.")
    mtp = min(set(adapters) - taken.used, default="").startswith("mtp.")  # the one refuse_left names
    taken.refuse_left("deepseek_v3", "transformers' DeepseekV3ForCausalLM " + (
        "does not run the multi-token prediction layers" if mtp else "has no such module"))
    return out, sorted(modules), sorted(params)
