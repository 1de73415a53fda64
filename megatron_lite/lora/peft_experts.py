"""PEFT adapters of MoE models exported for transformers 5's stacked experts: the parts the
``deepseek_v3`` export (:mod:`.peft_deepseek`) shares with the ``mixtral``, ``qwen3_moe`` and ``gpt_oss`` ones (here).

transformers 5 holds a MoE layer's routed experts as two stacked parameters, ``mlp.experts.gate_up_proj``
``[E, 2 ffn, h]`` and ``mlp.experts.down_proj`` ``[E, h, ffn]`` (``MixtralExperts``, ``Qwen3MoeExperts``,
DeepSeek-V3's), which PEFT adapts per expert as ``target_parameters`` (its ``ParamWrapper``: ``lora_A``
``[E r, in]`` holds expert e's A in rows ``e r .. (e + 1) r``, ``lora_B`` ``[out, r E]`` holds expert e's
B in columns ``e, E + e, ...``). Our expert fc1 is ``[gate; up]`` like ``gate_up_proj``, so its adapter
copies whole. Both parameters live on one module; PEFT wraps ``gate_up_proj`` (declared first) first,
so its adapter is saved under ``experts.base_layer`` and ``down_proj``'s under ``experts`` (with one of
the two adapted, under ``experts``).

gpt-oss (``GptOssExperts``) stores them transposed, ``gate_up_proj`` ``[E, h, 2 ffn]`` and ``down_proj``
``[E, ffn, h]`` (``x @ W``, marked ``is_transposed``: PEFT then reads ``[E, in, out]`` and adds
``(B_e A_e)^T``, the same ``lora_A`` / ``lora_B`` layout), with gate and up in alternating outputs
(gate even, up odd): fc1's B rows ``[gate; up]`` are interleaved the same way (a row permutation of B,
so the adapter stays exact). Its biases, the router and the attention sinks have no adapters. PEFT has
no weight conversion for ``gpt_oss`` (transformers has none), so its module targets are read as given.

Dense SwiGLU MLPs (Qwen3-MoE's dense layers, DeepSeek-V3's dense layers and shared experts) are
targeted by parameter too (``mlp.gate_proj.weight`` ...): PEFT with transformers 5 rewrites the module
targets ``gate_proj`` / ``up_proj`` / ``down_proj`` of these models (its ``qwen2_moe`` conversion) into
the experts' parameters and would drop the dense MLPs' adapters. A parameter-targeting adapter cannot
have dropout in PEFT, so the config says ``lora_dropout`` 0 when it has MLP adapters (dropout acts in
training only; the adapted model is the same).

``mixtral`` / ``qwen3_moe`` / ``gpt_oss`` attention is the llama export's: the fused QKV adapter's A copied to
``q_proj``, ``k_proj`` and ``v_proj`` and its B split into their rows; ``linear_proj`` -> ``o_proj``.
"""

from __future__ import annotations

import torch

from ..checkpoint.format import CheckpointError
from ..checkpoint.hf import _dims, qkv_to_separate
from ..checkpoint.hf_gptoss import check_gptoss, interleave
from ..moe.layer_pattern import parse_moe_layer_freq

IN, OUT = "adapter.linear_in.weight", "adapter.linear_out.weight"


class Taken:
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

    def refuse_left(self, style: str, why: str) -> None:
        """One line naming the first adapter no module took, ``why`` saying what the HF model lacks."""
        left = sorted(set(self.adapters) - self.used)
        if left:
            raise CheckpointError(f"adapter {left[0]} has no counterpart in the {style} PEFT export ({why}); "
                                  "pass --merge-lora")


def swiglu(out: dict, params: set, taken: Taken, src: str, dst: str) -> None:
    """Adapters of a SwiGLU MLP at ``src`` (ours) as those of HF's gate/up/down projections at ``dst``."""
    if (fc1 := taken.pair(src + "linear_fc1.")) is not None:
        gate, up = fc1[1].chunk(2, dim=0)
        out[dst + "gate_proj"], out[dst + "up_proj"] = (fc1[0], gate), (fc1[0], up)
    if (fc2 := taken.pair(src + "linear_fc2.")) is not None:
        out[dst + "down_proj"] = fc2
    params.update(f"{dst.split('.', 3)[-1]}{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")
                  if dst + n in out)


def stacked(pairs: list) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's ParamWrapper (lora_A ``[E r, in]``, lora_B ``[out, r E]``) of per-expert (A ``[r, in]``, B ``[out, r]``)."""
    a = torch.cat([a for a, _ in pairs])
    b = torch.stack([b for _, b in pairs], dim=-1)  # [out, r, E]: column r_i * E + e
    return a.contiguous(), b.reshape(b.shape[0], -1).contiguous()


def experts(out: dict, params: set, taken: Taken, src: str, dst: str, num_experts: int,
            interleaved: bool = False) -> None:
    """Adapters of layer ``src``'s routed experts (sequential or grouped) on HF's stacked experts at ``dst``;
    ``interleaved``: gpt-oss's ``gate_up_proj`` (gate and up in alternating outputs)."""
    found = {}
    for fc, name in ((1, "gate_up_proj"), (2, "down_proj")):
        pairs = taken.grouped(src + "mlp.experts.", fc)
        seq = [f"{src}mlp.experts.local_experts.{j}.linear_fc{fc}." for j in range(num_experts)]
        if pairs is None and all(p + w in taken.adapters for p in seq for w in (IN, OUT)):  # else left, and refused
            pairs = [taken.pair(p) for p in seq]
        if pairs is not None:
            if fc == 1 and interleaved:
                pairs = [(a, interleave(*b.t().chunk(2, dim=-1)).t()) for a, b in pairs]  # B rows gate, up, gate...
            found[name] = stacked(pairs)
            params.add(f"mlp.experts.{name}")
    if len(found) == 2:  # PEFT nests the wrappers: gate_up_proj (declared first) innermost
        out[dst + "mlp.experts.base_layer"], out[dst + "mlp.experts"] = found["gate_up_proj"], found["down_proj"]
    elif found:
        out[dst + "mlp.experts"] = next(iter(found.values()))


HF_CLASS = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "gpt_oss": "GptOssForCausalLM"}


def moe_modules(cfg: dict, adapters: dict, style: str) -> tuple[dict, list, list]:
    """({HF module name: (lora_A, lora_B)}, target_modules, target_parameters) of single-process
    ``adapters`` for a ``mixtral``, ``qwen3_moe`` or ``gpt_oss`` base (Qwen3-MoE may have dense layers)."""
    if style == "gpt_oss":  # the base's refusals first (a dense layer, SwiGLU experts...): one line, nothing written
        check_gptoss(cfg)
    layers, _, heads, groups, d = _dims(cfg)
    moe_layers = parse_moe_layer_freq(cfg.get("moe_layer_freq", 1), layers)
    num_experts, taken = int(cfg.get("num_experts") or 0), Taken(adapters)
    out, modules, params = {}, set(), set()
    for i in range(layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        if (qkv := taken.pair(src + "self_attention.linear_qkv.")) is not None:
            for name, b in zip(("q_proj", "k_proj", "v_proj"), qkv_to_separate(qkv[1], heads, groups, d)):
                out[f"{dst}self_attn.{name}"] = (qkv[0], b)
                modules.add(name)
        if (proj := taken.pair(src + "self_attention.linear_proj.")) is not None:
            out[dst + "self_attn.o_proj"] = proj
            modules.add("o_proj")
        if moe_layers[i]:
            experts(out, params, taken, src, dst, num_experts, interleaved=style == "gpt_oss")
        else:
            swiglu(out, params, taken, src + "mlp.", dst + "mlp.")
    taken.refuse_left(style, f"transformers' {HF_CLASS[style]} has no such module")
    return out, sorted(modules), sorted(params)
