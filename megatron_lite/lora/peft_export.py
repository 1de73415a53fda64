"""Export LoRA adapters as a Hugging Face PEFT adapter (``adapter_config.json`` + ``adapter_model.safetensors``).

The adapter belongs next to the Hugging Face export of its base (:func:`~megatron_lite.checkpoint.hf_folder.save_hf`):
``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)`` then computes what
the LoRA model computed. PEFT's scale is ``lora_alpha / r`` like ours, so the weights need no rescaling.
Keys are ``base_model.model.<HF module>.lora_A.weight`` (``[r, in]``) and ``.lora_B.weight``
(``[out, r]``), with the fused layers split the way the base export splits them:

* ``llama`` style (also ``qwen2``, the llama layout whose q/k/v biases stay in the base, and ``qwen3``, whose
  q/k norms stay in the base and follow the projections as ours do): the fused QKV adapter's A is copied to ``q_proj``, ``k_proj`` and ``v_proj`` and its
  B split into their rows (undoing the per-group interleave); fc1's A is copied to ``gate_proj`` and
  ``up_proj`` and its B halved (gate first); ``o_proj`` and ``down_proj`` are one-to-one.
* ``gpt2`` style: ``c_attn`` stays fused, its B rows reordered to HF's ``[Q; K; V]``; HF's Conv1D
  modules need ``fan_in_fan_out`` (PEFT then keeps ``lora_A``/``lora_B`` in the Linear layout above).

* ``mixtral``, ``qwen3_moe`` and ``gpt_oss`` styles: the attention as in the llama style (gpt-oss's q/k/v/o
  biases and sinks stay in the base), the routed experts (PEFT ``target_parameters`` on transformers'
  stacked experts; gpt-oss's fc1 B rows interleaved like its ``gate_up_proj``) and (Qwen3-MoE) the dense
  layers' MLPs (by parameter too): :mod:`.peft_experts`.
* ``deepseek_v3`` style: multi-latent attention's projections, the dense and shared-expert MLPs and the
  routed experts, the same way: :mod:`.peft_deepseek`.
"""

from __future__ import annotations

import os

import torch

from ..checkpoint.format import CheckpointError
from ..checkpoint.hf import _dims, pick_style, qkv_to_separate
from ..checkpoint.hf_io import write_json
from ..files import replaced_whole
from .peft_deepseek import deepseek_modules
from .peft_experts import moe_modules

ADAPTER_DIR = "adapter"
STYLES = ("gpt2", "llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3")  # the --hf-style values exported
OURS = {"qkv": "self_attention.linear_qkv", "proj": "self_attention.linear_proj", "fc1": "mlp.linear_fc1",
        "fc2": "mlp.linear_fc2"}


def _pairs(adapters: dict, layer: int, part: str):
    """(A, B) of layer ``layer``'s adapter on ``part`` (a key of OURS), or None when it has none."""
    prefix = f"decoder.layers.{layer}.{OURS[part]}.adapter."
    a, b = adapters.get(prefix + "linear_in.weight"), adapters.get(prefix + "linear_out.weight")
    return None if a is None else (a, b)


def _llama_modules(cfg: dict, adapters: dict, i: int) -> dict:
    _, _, heads, groups, d = _dims(cfg)
    out, layer = {}, f"model.layers.{i}."
    if (qkv := _pairs(adapters, i, "qkv")) is not None:
        for name, b in zip(("q_proj", "k_proj", "v_proj"), qkv_to_separate(qkv[1], heads, groups, d)):
            out[f"{layer}self_attn.{name}"] = (qkv[0], b)
    if (proj := _pairs(adapters, i, "proj")) is not None:
        out[f"{layer}self_attn.o_proj"] = proj
    if (fc1 := _pairs(adapters, i, "fc1")) is not None:
        gate, up = fc1[1].chunk(2, dim=0)
        out[f"{layer}mlp.gate_proj"], out[f"{layer}mlp.up_proj"] = (fc1[0], gate), (fc1[0], up)
    if (fc2 := _pairs(adapters, i, "fc2")) is not None:
        out[f"{layer}mlp.down_proj"] = fc2
    return out


def _gpt2_modules(cfg: dict, adapters: dict, i: int) -> dict:
    _, _, heads, groups, d = _dims(cfg)
    out, layer = {}, f"transformer.h.{i}."
    if (qkv := _pairs(adapters, i, "qkv")) is not None:
        out[f"{layer}attn.c_attn"] = (qkv[0], torch.cat(qkv_to_separate(qkv[1], heads, groups, d)))
    for part, name in (("proj", "attn.c_proj"), ("fc1", "mlp.c_fc"), ("fc2", "mlp.c_proj")):
        if (pair := _pairs(adapters, i, part)) is not None:
            out[layer + name] = pair
    return out


def _modules(cfg: dict, adapters: dict, style: str) -> dict:
    """{HF module name: (A, B)} of the gpt2 / llama-like (dense) styles; refuses adapters these styles do not hold."""
    if any(".experts." in k for k in adapters):
        moe = pick_style(cfg)  # the MoE format auto picks: mixtral, qwen3_moe or gpt_oss
        raise CheckpointError(f"the {style} format has no experts for the experts' LoRA adapters; use --hf-style {moe}")
    modules = {}
    for i in range(cfg["num_layers"]):
        modules.update((_gpt2_modules if style == "gpt2" else _llama_modules)(cfg, adapters, i))
    exported = {f"decoder.layers.{i}.{part}.adapter.linear_{w}.weight" for i in range(cfg["num_layers"])
                for part in OURS.values() for w in ("in", "out")}
    if set(adapters) - exported:
        raise CheckpointError(f"adapter {sorted(set(adapters) - exported)[0]} has no PEFT export here; pass --merge-lora")
    return modules


def peft_adapter(cfg: dict, adapters: dict, style: str, base_path: str) -> tuple[dict, dict]:
    """(adapter_config.json dict, safetensors tensors) of single-process ``adapters`` for a ``style`` base."""
    if style not in STYLES:
        raise CheckpointError(f"PEFT export of LoRA adapters supports the {', '.join(STYLES)} styles, not {style}; "
                              "pass --merge-lora to export the merged model instead")
    targets, params = [], []
    if style == "deepseek_v3":
        modules, targets, params = deepseek_modules(cfg, adapters)
    elif style in ("mixtral", "qwen3_moe", "gpt_oss"):
        modules, targets, params = moe_modules(cfg, adapters, style)
    else:
        modules = _modules(cfg, adapters, style)
        # module names as PEFT matches them (a suffix of the full name): leaf names, or attn./mlp. for GPT-2's two c_proj
        targets = sorted({n.split(".", 3)[-1] if style == "gpt2" else n.rsplit(".", 1)[-1] for n in modules})
    tensors = {}
    for name, (a, b) in modules.items():
        tensors[f"base_model.model.{name}.lora_A.weight"] = a.clone()  # own storage: safetensors refuses shared
        tensors[f"base_model.model.{name}.lora_B.weight"] = b.clone()
    config = {
        "peft_type": "LORA", "auto_mapping": None, "base_model_name_or_path": os.path.abspath(base_path),
        "bias": "none", "fan_in_fan_out": style == "gpt2", "inference_mode": True, "init_lora_weights": True,
        "lora_alpha": cfg["lora_alpha"], "lora_dropout": 0.0 if params else cfg.get("lora_dropout", 0.0),
        "modules_to_save": None,
        "r": cfg["lora_rank"], "rank_pattern": {}, "alpha_pattern": {}, "target_modules": targets,
        "target_parameters": params or None,
        "task_type": "CAUSAL_LM", "use_dora": False, "use_rslora": False,
    }
    return config, tensors


def save_peft_adapter(cfg: dict, adapters: dict, style: str, base_dir: str, folder: str | None = None) -> str:
    """Write the PEFT adapter of the base in ``base_dir`` into ``<folder>/adapter`` (``folder``: where
    the base is being written, by default ``base_dir``); returns that folder."""
    from safetensors.torch import save_file

    config, tensors = peft_adapter(cfg, adapters, style, base_dir)
    out = os.path.join(base_dir if folder is None else folder, ADAPTER_DIR)
    os.makedirs(out, exist_ok=True)
    with replaced_whole(os.path.join(out, "adapter_model.safetensors")) as tmp:
        save_file(tensors, tmp, metadata={"format": "pt"})
    write_json(os.path.join(out, "adapter_config.json"), config)
    return out
