"""The flags of hybrid Mamba-2 models (Nemotron-H style): which layers are Mamba, attention or MLP,
and the Mamba-2 mixer's sizes. Megatron-LM's names and CLI defaults.

A hybrid model is one layer per character of its layer pattern: ``M`` a Mamba layer (norm + Mamba-2
mixer + residual, :mod:`~megatron_lite.models.mamba`), ``*`` an attention layer (norm + self-attention
+ residual), ``-`` an MLP layer (norm + MLP + residual). The pattern is ``--hybrid-override-pattern``
(its length must be ``--num-layers``), or allocated from ``--hybrid-attention-ratio`` and
``--hybrid-mlp-ratio`` (:func:`allocate_layers`: attention layers evenly spaced between Mamba runs,
then MLP layers right-justified among the Mamba ones, Megatron-LM's rule); both given, the pattern must
hold the ratios' counts of each kind. ``--is-hybrid-model`` alone: every layer Mamba.

:class:`MambaConfig` is mixed into the ``model`` section of the run's Config (saved with checkpoints)
and into :class:`~megatron_lite.models.transformer_config.TransformerConfig`; :func:`check_mamba_fields`
validates them there, :func:`check_hybrid_run` refuses what is not built for hybrid models.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..errors import ConfigError

MAMBA, ATTENTION, MLP = "M", "*", "-"
SYMBOLS = (MAMBA, ATTENTION, MLP)
MAMBA_EXPAND = 2  # d_inner = 2 x hidden (Megatron-LM's MambaMixer default; no flag)
MAMBA_CONV_KERNEL = 4  # the causal depthwise conv1d's width (no flag)
MAMBA_CHUNK_SIZE = 128  # the SSD scan's chunk length (no flag; the numbers do not depend on it)


@dataclass
class MambaConfig:
    is_hybrid_model: bool = False
    """Build a hybrid Mamba-2 model (alone: every layer a Mamba layer; see --hybrid-override-pattern)."""
    hybrid_attention_ratio: float = 0.0
    """Hybrid model: fraction of the layers that are attention layers (evenly spaced among the Mamba layers)."""
    hybrid_mlp_ratio: float = 0.0
    """Hybrid model: fraction of the layers that are MLP layers."""
    hybrid_override_pattern: str | None = None
    """Hybrid model: one character per layer, M Mamba, * attention, - MLP (e.g. M-M*-M-); its length is --num-layers."""
    mamba_state_dim: int = 128
    """Mamba-2: state dimension N of the SSM (per group)."""
    mamba_head_dim: int = 64
    """Mamba-2: head dimension P."""
    mamba_num_groups: int = 8
    """Mamba-2: groups sharing B and C (must divide the heads and be a multiple of --tensor-model-parallel-size)."""
    mamba_num_heads: int | None = None
    """Mamba-2: number of heads (default 2 x hidden-size / mamba-head-dim; given: the mixer's inner size is heads x head dim)."""
    disable_mamba_mem_eff_path: bool = False
    """Mamba-2: Megatron-LM's switch off its fused kernel path; no effect here (one plain PyTorch path)."""


MAMBA_SIZES = ("mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads")


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def is_hybrid(config) -> bool:
    """Whether the model (a ModelConfig or TransformerConfig) is a hybrid Mamba model."""
    return bool(getattr(config, "is_hybrid_model", False) or getattr(config, "hybrid_override_pattern", None)
                or getattr(config, "hybrid_attention_ratio", 0) or getattr(config, "hybrid_mlp_ratio", 0))


def saved_is_hybrid(saved: dict) -> bool:
    """Whether a checkpoint's flat config (a dict) holds a hybrid Mamba model."""
    return is_hybrid(type("Saved", (), {k: saved.get(k) for k in
                                        ("is_hybrid_model", "hybrid_override_pattern", "hybrid_attention_ratio",
                                         "hybrid_mlp_ratio")}))


def _allocate_auto(n: int, attention_ratio: float, mlp_ratio: float) -> list[str]:
    """Megatron-LM's allocation: round(n x ratio) attention layers, evenly spaced so that the Mamba
    runs before, between and after them are as equal as possible; then round(n x mlp ratio) MLP layers
    spread the same way over the remaining Mamba positions."""
    layers = [MAMBA] * n
    attention = round(n * attention_ratio)
    mamba = n - attention
    run = mamba / (attention + 1)
    left = run
    for i in range(n):
        if left < 0.5:
            layers[i] = ATTENTION
            left += run
        else:
            left -= 1
    mlp = round(n * mlp_ratio)
    if mlp > 0:
        per_mlp = (mamba - mlp) / mlp
        left = per_mlp
        for i in range(n):
            if layers[i] == MAMBA:
                if left < 0.5:
                    layers[i] = MLP
                    left += per_mlp
                else:
                    left -= 1
    return layers


def allocate_layers(num_layers: int, attention_ratio: float = 0.0, mlp_ratio: float = 0.0,
                    pattern: str | None = None) -> list[str]:
    """Each layer's kind (``M``, ``*`` or ``-``), from the pattern or the ratios; ConfigError naming the flag."""
    _require(0 <= attention_ratio <= 1 and 0 <= mlp_ratio <= 1 and attention_ratio + mlp_ratio <= 1,
             f"--hybrid-attention-ratio {attention_ratio} and --hybrid-mlp-ratio {mlp_ratio} must be in [0, 1] "
             "with a sum of at most 1")
    auto = _allocate_auto(num_layers, attention_ratio, mlp_ratio)
    if pattern is None:
        return auto
    for ch in pattern:
        if ch in "|/E":
            what = {"|": "pipeline stage splits ('|')", "/": "multi-token prediction layers ('/')",
                    "E": "MoE layers ('E')"}[ch]
            raise ConfigError(f"--hybrid-override-pattern {pattern!r}: {what} are not built here; use only "
                              "M (Mamba), * (attention) and - (MLP)")
        _require(ch in SYMBOLS, f"--hybrid-override-pattern {pattern!r}: {ch!r} is not a layer symbol; use M "
                 "(Mamba), * (attention) and - (MLP)")
    _require(len(pattern) == num_layers, f"--hybrid-override-pattern {pattern!r} has {len(pattern)} layers and "
             f"--num-layers is {num_layers}; give one character per layer")
    if attention_ratio or mlp_ratio:
        _require(all(pattern.count(s) == auto.count(s) for s in SYMBOLS),
                 f"--hybrid-override-pattern {pattern!r} does not hold the layer counts of --hybrid-attention-ratio "
                 f"{attention_ratio} / --hybrid-mlp-ratio {mlp_ratio} ({''.join(auto)}); drop the ratios or match them")
    return list(pattern)


def hybrid_layers(config) -> list[str]:
    """Each layer's kind for a hybrid config (``num_layers`` entries)."""
    return allocate_layers(config.num_layers, config.hybrid_attention_ratio, config.hybrid_mlp_ratio,
                           config.hybrid_override_pattern)


def mamba_sizes(config) -> tuple[int, int, int, int, int]:
    """``(d_inner, heads, head_dim, groups, state_dim)`` of the model's Mamba-2 mixers."""
    head_dim = config.mamba_head_dim
    heads = config.mamba_num_heads or (MAMBA_EXPAND * config.hidden_size) // head_dim
    return heads * head_dim, heads, head_dim, config.mamba_num_groups, config.mamba_state_dim


def check_mamba_fields(config) -> None:
    """Validate the hybrid fields of a TransformerConfig (one line naming the flag)."""
    if not is_hybrid(config):
        defaults = {f.name: f.default for f in dataclasses.fields(MambaConfig)}
        for name in MAMBA_SIZES + ("disable_mamba_mem_eff_path",):
            if getattr(config, name) != defaults[name]:
                flag = f"--{name.replace('_', '-')}"
                raise ConfigError(f"{flag} has no effect without a hybrid model (--hybrid-override-pattern, "
                                  f"--hybrid-attention-ratio / --hybrid-mlp-ratio or --is-hybrid-model); add one or drop {flag}")
        return
    hybrid_layers(config)
    for name in ("mamba_state_dim", "mamba_head_dim", "mamba_num_groups"):
        _require(getattr(config, name) > 0, f"--{name.replace('_', '-')} must be positive")
    _require(config.mamba_num_heads is None or config.mamba_num_heads > 0, "--mamba-num-heads must be positive")
    _require(config.mamba_num_heads is not None or (MAMBA_EXPAND * config.hidden_size) % config.mamba_head_dim == 0,
             f"--mamba-head-dim {config.mamba_head_dim} must divide 2 x --hidden-size {config.hidden_size} (the "
             "mixer's inner size), or give --mamba-num-heads")
    _, heads, _, groups, _ = mamba_sizes(config)
    _require(heads % groups == 0, f"--mamba-num-groups {groups} must divide the {heads} Mamba heads")
    tp = config.tensor_model_parallel_size
    _require(groups % tp == 0, f"--mamba-num-groups {groups} must be a multiple of --tensor-model-parallel-size "
             f"{tp} (each rank holds whole groups of heads, so the gated norm needs no communication)")
    _require(not config.num_experts, "--num-experts with a hybrid Mamba model: MoE layers ('E') are not built "
             "for hybrid models; drop --num-experts")
    _require(not config.multi_latent_attention, "--multi-latent-attention is not built for hybrid Mamba models; drop it")
    _require(not config.mtp_num_layers, "--mtp-num-layers is not built for hybrid Mamba models; drop it")
    _require(config.context_parallel_size == 1, "--context-parallel-size > 1 is not built for hybrid Mamba models "
             "(the scan would need the previous rank's state); use --context-parallel-size 1")
    _require(not config.spec, "--spec with a hybrid Mamba model: the layer pattern builds the layers; drop one")
    _require(config.fp8 is None and config.transformer_impl == "local", "--fp8-format / --transformer-impl "
             "transformer_engine are not tested for hybrid Mamba models; drop them")


def check_hybrid_run(config) -> None:
    """Refuse the run-level features not built for hybrid models (a run's whole Config)."""
    if not is_hybrid(config.model):
        return
    _require(not config.fusion.torch_compile, "--torch-compile is not built for hybrid Mamba models; drop it")
    _require(config.lora.lora_rank is None, "--lora-rank with a hybrid Mamba model: adapters on the Mamba mixer "
             "are not built; drop --lora-rank")
    _require("bert" not in config.extra_sections, "pretrain_bert.py does not build hybrid Mamba models; use "
             "pretrain_gpt.py")
