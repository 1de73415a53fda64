"""PEFT adapter of a LoRA model exported in the ``deepseek_v3`` style (multi-latent attention, dense
layers then MoE layers), for transformers' ``DeepseekV3ForCausalLM`` (:mod:`megatron_lite.checkpoint.hf_deepseek`).

Attention (PEFT ``target_modules``, one-to-one like the base weights): ``linear_q_proj`` -> ``q_proj``,
``linear_q_up_proj`` -> ``q_b_proj``, ``linear_kv_up_proj`` -> ``kv_b_proj``, ``linear_proj`` -> ``o_proj``.

MLP (PEFT ``target_parameters``): transformers holds a MoE layer's routed experts as two stacked
parameters, ``mlp.experts.gate_up_proj`` ``[E, 2 ffn, h]`` and ``mlp.experts.down_proj`` ``[E, h, ffn]``,
which PEFT adapts per expert (its ``ParamWrapper``: ``lora_A`` ``[E r, in]`` holds expert e's A in rows
``e r .. (e + 1) r``, ``lora_B`` ``[out, r E]`` holds expert e's B in columns ``e, E + e, ...``). Our
expert fc1 is ``[gate; up]`` like ``gate_up_proj``, so its adapter copies whole. Both parameters live
on one module; PEFT wraps ``gate_up_proj`` first, so its adapter is saved under ``experts.base_layer``
and ``down_proj``'s under ``experts`` (with one of the two adapted, under ``experts``). The dense
MLPs and the shared experts are targeted by parameter too (``mlp.gate_proj.weight`` ...): PEFT with
transformers 5 rewrites the module targets ``gate_proj`` / ``up_proj`` / ``down_proj`` of a DeepSeek-V3
model into the experts' parameters and would drop the dense layers' adapters. A parameter-targeting
adapter cannot have dropout in PEFT, so the config says ``lora_dropout`` 0 when it has MLP adapters
(dropout acts in training only; the adapted model is the same).
"""

from __future__ import annotations

import torch

from ..checkpoint.format import CheckpointError

ATTENTION = (("linear_q_proj", "q_proj"), ("linear_q_up_proj", "q_b_proj"), ("linear_kv_up_proj", "kv_b_proj"),
             ("linear_proj", "o_proj"))
IN, OUT = "adapter.linear_in.weight", "adapter.linear_out.weight"


class _Taken:
    """The adapters, handing out each (A, B) pair once so that what is left over can be named."""

    def __init__(self, adapters: dict):
        self.adapters, self.used = adapters, set()

    def pair(self, prefix: str):
        a, b = self.adapters.get(prefix + IN), self.adapters.get(prefix + OUT)
        if a is None or b is None:
            return None
        self.used.update((prefix + IN, prefix + OUT))
        return a, b

    def grouped(self, prefix: str, fc: int):
        """Expert pairs of grouped experts' fc ``fc`` (A ``[E, in, r]``, B ``[E, r, out]``), as [(A_e, B_e)]."""
        a_key, b_key = f"{prefix}linear_fc{fc}_adapter.linear_in.weight", f"{prefix}linear_fc{fc}_adapter.linear_out.weight"
        if a_key not in self.adapters:
            return None
        self.used.update((a_key, b_key))
        return [(a.t(), b.t()) for a, b in zip(self.adapters[a_key], self.adapters[b_key])]


def _swiglu(out: dict, params: set, taken: _Taken, src: str, dst: str) -> None:
    """Adapters of a SwiGLU MLP at ``src`` (ours) as those of HF's gate/up/down projections at ``dst``."""
    if (fc1 := taken.pair(src + "linear_fc1.")) is not None:
        gate, up = fc1[1].chunk(2, dim=0)
        out[dst + "gate_proj"], out[dst + "up_proj"] = (fc1[0], gate), (fc1[0], up)
    if (fc2 := taken.pair(src + "linear_fc2.")) is not None:
        out[dst + "down_proj"] = fc2
    params.update(f"{dst.split('.', 3)[-1]}{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")
                  if dst + n in out)


def _stacked(pairs: list) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's ParamWrapper (lora_A ``[E r, in]``, lora_B ``[out, r E]``) of per-expert (A ``[r, in]``, B ``[out, r]``)."""
    a = torch.cat([a for a, _ in pairs])
    b = torch.stack([b for _, b in pairs], dim=-1)  # [out, r, E]: column r_i * E + e
    return a.contiguous(), b.reshape(b.shape[0], -1).contiguous()


def _experts(out: dict, params: set, taken: _Taken, src: str, dst: str, experts: int) -> None:
    found = {}
    for fc, name in ((1, "gate_up_proj"), (2, "down_proj")):
        pairs = taken.grouped(src + "mlp.experts.", fc)
        if pairs is None:
            seq = [taken.pair(f"{src}mlp.experts.local_experts.{j}.linear_fc{fc}.") for j in range(experts)]
            pairs = None if any(p is None for p in seq) else seq
        if pairs is not None:
            found[name] = _stacked(pairs)
            params.add(f"mlp.experts.{name}")
    if len(found) == 2:  # PEFT nests the wrappers: gate_up_proj (declared first) innermost
        out[dst + "mlp.experts.base_layer"], out[dst + "mlp.experts"] = found["gate_up_proj"], found["down_proj"]
    elif found:
        out[dst + "mlp.experts"] = next(iter(found.values()))


def deepseek_modules(cfg: dict, adapters: dict) -> tuple[dict, list, list]:
    """({HF module name: (lora_A, lora_B)}, target_modules, target_parameters) of single-process ``adapters``."""
    from ..checkpoint.hf_deepseek import _layer_pattern

    pattern, _ = _layer_pattern(cfg)
    experts, taken = int(cfg.get("num_experts") or 0), _Taken(adapters)
    out, modules, params = {}, set(), set()
    for i in range(cfg["num_layers"]):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        for ours, theirs in ATTENTION:
            if (pair := taken.pair(f"{src}self_attention.{ours}.")) is not None:
                out[f"{dst}self_attn.{theirs}"] = pair
                modules.add(theirs)
        if pattern[i]:
            _swiglu(out, params, taken, src + "mlp.shared_experts.", dst + "mlp.shared_experts.")
            _experts(out, params, taken, src, dst, experts)
        else:
            _swiglu(out, params, taken, src + "mlp.", dst + "mlp.")
    left = sorted(set(adapters) - taken.used)
    if left:
        why = ("transformers' DeepseekV3ForCausalLM does not run the multi-token prediction layers" if
               left[0].startswith("mtp.") else "transformers' DeepseekV3ForCausalLM has no such module")
        raise CheckpointError(f"adapter {left[0]} has no counterpart in the deepseek_v3 PEFT export ({why}); "
                              "pass --merge-lora")
    return out, sorted(modules), sorted(params)
