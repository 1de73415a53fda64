"""The flags of DeepSeek-style models: multi-latent attention (MLA), its YaRN rotary embedding, and
multi-token prediction (MTP). Megatron-LM's names and CLI defaults.

:class:`MLAConfig` and :class:`MTPConfig` are mixed into the ``model`` section of the run's Config
(so the flags sit with the other model flags and are saved with checkpoints) and into
:class:`~megatron_lite.models.transformer_config.TransformerConfig` (so every layer sees them);
:func:`check_mla_fields` validates them there with one line naming the flag and the fix.

Megatron's CLI defaults do not describe DeepSeek-V3 (``--kv-lora-rank 32``, no q compression,
``--rotary-scaling-factor 1``, ``--mscale-all-dim 0``): a DeepSeek-V3 run passes them all
(``examples/deepseek_v3/train_deepseek_v3_671b.sh``). ``--original-max-position-embeddings``,
``--beta-fast`` and ``--beta-slow`` are config-only in Megatron (its defaults, 4096 / 32 / 1, are
DeepSeek-V3's); here they are flags with the same defaults.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..errors import ConfigError

ROPE_TYPES = ("rope", "yarn")


@dataclass
class MLAConfig:
    multi_latent_attention: bool = False
    """Multi-latent attention (DeepSeek-V2/V3): keys and values from one compressed latent per token."""
    q_lora_rank: int | None = None
    """MLA: rank of the query compression (default: no compression, one query projection)."""
    kv_lora_rank: int = 32
    """MLA: rank of the key/value latent."""
    qk_head_dim: int = 128
    """MLA: per-head query/key dimension without the rotary part."""
    qk_pos_emb_head_dim: int = 64
    """MLA: per-head rotary (decoupled RoPE) dimension of queries and of the key shared by all heads."""
    v_head_dim: int = 128
    """MLA: per-head value dimension."""
    qk_layernorm: bool = False
    """Normalise queries and keys: per head before RoPE (--normalization over --kv-channels, one weight for all heads; Qwen3, Gemma-3 with --apply-layernorm-1p; not OLMo-2, which norms all heads at once), or MLA's query and key/value latents (DeepSeek-V2/V3)."""
    rope_type: str | None = None
    """Rotary embedding: rope or yarn (default: yarn with --multi-latent-attention, rope otherwise); yarn also scales a standard attention's rotary embedding (gpt-oss)."""
    rotary_scaling_factor: float = 1.0
    """YaRN: context extension factor (DeepSeek-V3: 40)."""
    mscale: float = 1.0
    """YaRN: mscale of the rotary tables' magnitude."""
    mscale_all_dim: float = 0.0
    """YaRN: mscale_all_dim; MLA's softmax scale is (0.1 x this x ln(factor) + 1)^2 / sqrt(q head dim)."""
    original_max_position_embeddings: int = 4096
    """YaRN: the context length the model was pretrained with."""
    beta_fast: float = 32.0
    """YaRN: rotations per context above which a frequency is kept (not interpolated)."""
    beta_slow: float = 1.0
    """YaRN: rotations per context below which a frequency is fully interpolated."""
    yarn_correction_range_round_to_int: bool = True
    """YaRN: floor / ceil the correction range's channel bounds (DeepSeek-V3); --no-yarn-correction-range-round-to-int keeps them fractional (gpt-oss)."""


@dataclass
class MTPConfig:
    mtp_num_layers: int | None = None
    """Multi-token prediction depth: extra layers predicting tokens 2..D+1 ahead (default: none)."""
    mtp_loss_scaling_factor: float = 0.1
    """Weight of the multi-token prediction loss: scaling / D x sum of the depths' losses."""


MLA_SIZES = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")


def unused_deepseek_flag(model) -> str | None:
    """A run's MLA sizes without --multi-latent-attention, --mtp-loss-scaling-factor without
    --mtp-num-layers, given a value other than the default, or an MLA run's --kv-channels other than
    the derived head size (the model would ignore each): one line naming the flag, else None. Checked
    for a run's flags only (a saved config still loads)."""
    if model.multi_latent_attention and model.kv_channels not in (None, model.hidden_size // model.num_attention_heads):
        return (f"--kv-channels {model.kv_channels} has no effect with --multi-latent-attention (its head sizes are "
                "--qk-head-dim, --qk-pos-emb-head-dim and --v-head-dim); drop --kv-channels")
    defaults = {f.name: f.default for f in dataclasses.fields(MLAConfig) + dataclasses.fields(MTPConfig)}
    unused = () if model.multi_latent_attention else MLA_SIZES
    unused += () if model.mtp_num_layers else ("mtp_loss_scaling_factor",)
    for name in unused:
        if getattr(model, name) != defaults[name]:
            flag = f"--{name.replace('_', '-')}"
            needs = "--mtp-num-layers" if name.startswith("mtp") else "--multi-latent-attention"
            return (f"{flag} {getattr(model, name)} has no effect without {needs} (this model would ignore it); "
                    f"add {needs} or drop {flag}")
    return unused_yarn_flag(model)


# YaRN's fields that only the YaRN tables read; MLA's softmax scale also reads these two whatever --rope-type is
YARN_TABLE_FIELDS = ("mscale", "original_max_position_embeddings", "beta_fast", "beta_slow",
                     "yarn_correction_range_round_to_int")
MLA_SCALE_FIELDS = ("rotary_scaling_factor", "mscale_all_dim")


def unused_yarn_flag(model) -> str | None:
    """A YaRN flag other than its default on a model whose rotary tables are not YaRN (``--rope-type
    rope``, or no --rope-type without MLA): one line naming it, else None. Under MLA the factor and
    --mscale-all-dim still set the softmax scale (as in Megatron-LM), so they pass there."""
    if (model.rope_type or ("yarn" if model.multi_latent_attention else "rope")) == "yarn":
        return None
    defaults = {f.name: f.default for f in dataclasses.fields(MLAConfig)}
    for name in YARN_TABLE_FIELDS + (() if model.multi_latent_attention else MLA_SCALE_FIELDS):
        if getattr(model, name) != defaults[name]:
            flag = ("--no-yarn-correction-range-round-to-int" if name == "yarn_correction_range_round_to_int"
                    else f"--{name.replace('_', '-')} {getattr(model, name)}")
            return (f"{flag} has no effect without --rope-type yarn (this model's rotary tables are plain RoPE); "
                    f"add --rope-type yarn or drop {flag.split()[0]}")
    return None


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def derive_rope_type(config) -> None:
    """Megatron's default: yarn under MLA, rope otherwise."""
    if config.rope_type is None:
        config.rope_type = "yarn" if config.multi_latent_attention else "rope"


def check_mla_fields(config) -> None:
    """Validate the MLA, YaRN and MTP fields of a TransformerConfig (after :func:`derive_rope_type`)."""
    _require(config.rope_type in ROPE_TYPES, f"--rope-type {config.rope_type!r} is not one of {', '.join(ROPE_TYPES)}")
    if config.rope_type == "yarn":
        _require(config.multi_latent_attention or config.position_embedding_type == "rope",
                 "--rope-type yarn needs --position-embedding-type rope (or --multi-latent-attention)")
        scaled = config.use_rope_scaling or config.rotary_seq_len_interpolation_factor not in (None, 1)
        _require(config.multi_latent_attention or not scaled,  # (MLA refuses them in rope_config.py)
                 "--rope-type yarn replaces --use-rope-scaling and --rotary-seq-len-interpolation-factor; drop them")
        _require(config.rotary_scaling_factor > 0 and config.original_max_position_embeddings > 0,
                 "--rotary-scaling-factor and --original-max-position-embeddings must be positive")
        _require(config.beta_slow > 0 and config.beta_fast >= config.beta_slow,
                 f"--beta-fast {config.beta_fast} and --beta-slow {config.beta_slow} must be positive with "
                 "--beta-fast >= --beta-slow (rotations per --original-max-position-embeddings; DeepSeek-V3: 32 and 1)")
        _require(config.rotary_base > 1, f"--rotary-base {config.rotary_base} must be above 1 with --rope-type yarn")
    if config.multi_latent_attention:
        check_mla_shape(config)
    if config.mtp_num_layers is not None:
        _require(config.mtp_num_layers >= 1, f"--mtp-num-layers {config.mtp_num_layers} must be at least 1")
        # depth k predicts the token k + 1 ahead of each position: from k = --seq-length on, no position of
        # the sequence has one, and that depth's loss was 0 (averaged into the MTP loss) at every step
        _require(config.mtp_num_layers < config.seq_length,
                 f"--mtp-num-layers {config.mtp_num_layers} must be less than --seq-length {config.seq_length} "
                 "(MTP depth k predicts the token k + 1 positions ahead: depths k >= --seq-length have no "
                 "position to predict from); use fewer MTP layers or a longer --seq-length")
        check_mtp_positions(config)
        _require(config.mtp_loss_scaling_factor >= 0, "--mtp-loss-scaling-factor must not be negative")


def check_mtp_positions(config) -> None:
    """Multi-token prediction layers take rotary positions only (the planner checks its models here too)."""
    _require(config.position_embedding_type == "rope",
             "--mtp-num-layers needs --position-embedding-type rope (as in Megatron-LM)")


def check_mla_shape(config) -> None:
    """MLA's sizes, positions and heads (a TransformerConfig, or the planner's ModelSpec)."""
    for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
        _require(getattr(config, name) > 0, f"--{name.replace('_', '-')} must be positive")
    _require(config.q_lora_rank is None or config.q_lora_rank > 0, "--q-lora-rank must be positive (or left unset)")
    _require(config.qk_pos_emb_head_dim % 2 == 0,
             f"--qk-pos-emb-head-dim {config.qk_pos_emb_head_dim} must be even (rotary pairs)")
    _require(config.position_embedding_type == "rope",
             "--multi-latent-attention needs --position-embedding-type rope (MLA rotates its own rotary part; "
             "learned absolute positions on top are not built)")
    _require(not getattr(config, "add_qkv_bias", False), "--add-qkv-bias applies to the fused QKV projection of "
             "standard attention; --multi-latent-attention has none: drop --add-qkv-bias")
    _require(config.num_query_groups == config.num_attention_heads,
             "--multi-latent-attention does not take --group-query-attention / --num-query-groups (every head "
             "has its own keys and values from the latent)")
