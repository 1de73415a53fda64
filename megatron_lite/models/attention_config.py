"""Four attention flags of standard (not multi-latent) attention, with Megatron-LM's names and defaults.

* ``--rotary-interleaved``: the rotary embedding rotates adjacent channel pairs ``(x0, x1), (x2, x3), ...``
  (GPT-J / Meta's Llama layout) instead of the two halves ``(x_i, x_{i + d/2})``; pair ``i`` turns by the
  same angle ``position x base^(-2i/d)`` in both layouts (:func:`~megatron_lite.models.common.apply_rotary_interleaved`).
* ``--softmax-scale S``: the attention logits are ``q k^T x S`` instead of ``q k^T / sqrt(head size)``.
  ``--apply-query-key-layer-scaling`` divides it by the layer number in the product and multiplies it back
  in the fp32 softmax, as it does the default scale, so the two combine to ``S``.
* ``--attention-output-gate`` (Qwen3-Next's gated attention): the QKV projection also gives one gate
  channel per query channel; the core attention's output is multiplied by ``sigmoid(gate)`` (in fp32,
  rounded back to the activations' dtype) before the output projection. The fused QKV weight holds, per
  key/value group, ``[its query heads | their gate heads | key head | value head]`` (Megatron-LM's layout),
  so tensor parallelism still splits whole groups and the gate of a rank's heads is on that rank.
* ``--no-rope-freq``: the layers that skip the rotary embedding (Llama 4's NoPE layers). ``N``: layer ``l``
  (counted from 1) skips it when ``l mod N == 0``, and ``--num-layers`` must be a multiple of ``N``; or
  a list expression of one 0/1 per layer, ``"([0]*3+[1])*2"`` (1 = no rotary).

Megatron-LM's multi-latent attention applies none of them (its scale comes from its YaRN settings,
its rotary part has its own layout), so each is refused with ``--multi-latent-attention``; and
``--no-rope-freq`` with ``--mtp-num-layers`` (which entry an MTP layer takes is not defined).

:class:`AttentionConfig` is mixed into the ``model`` section of the run's Config (saved with
checkpoints) and into :class:`~megatron_lite.models.transformer_config.TransformerConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ConfigError
from ..moe.layer_pattern import zero_one_list


@dataclass
class AttentionConfig:
    rotary_interleaved: bool = False
    """Rotary embedding on adjacent channel pairs (x0, x1), (x2, x3), ... (GPT-J / Llama 4 layout) instead of the two halves of each head."""
    softmax_scale: float | None = None
    """Scale of the attention logits (q k^T x this) instead of 1 / sqrt(head size). Default: 1 / sqrt(head size)."""
    attention_output_gate: bool = False
    """Gated attention (Qwen3-Next): the QKV projection also gives a gate per query channel, and the attention output is multiplied by sigmoid(gate) before the output projection."""
    no_rope_freq: str | None = field(default=None, metadata={"metavar": "N"})
    """Layers without the rotary embedding (Llama 4's NoPE layers). N: layer l (counted from 1) when l mod N is 0 (--num-layers a multiple of N); or a list of one 0/1 per layer, e.g. "([0]*3+[1])*2" (1 = no rotary). Default: rotary in every layer."""


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def no_rope_layers(value, num_layers: int) -> list[bool]:
    """Per layer (0-based), whether it skips the rotary embedding. Raises ValueError with the reason."""
    if value is None:
        return [False] * num_layers
    text = str(value).strip()
    if text.lstrip("-").isdigit():
        n = int(text)
        if n < 1 or num_layers % n:
            raise ValueError(f"must be a positive integer that divides --num-layers {num_layers}, or a list "
                             "expression of one 0/1 per layer")
        return [(i + 1) % n == 0 for i in range(num_layers)]
    pattern = zero_one_list(text, num_layers)
    if pattern is None:
        raise ValueError(f"must be an integer N or a list of {num_layers} zeros and ones (1 = no rotary), "
                         "e.g. \"([0]*3+[1])*2\"")
    return pattern


def layer_skips_rope(config, layer_number: int) -> bool:
    """Whether global layer ``layer_number`` (1-based) runs without the rotary embedding (--no-rope-freq)."""
    value = getattr(config, "no_rope_freq", None)
    if value is None:
        return False
    return no_rope_layers(value, config.num_layers)[layer_number - 1]


def attention_flags_in_use(config) -> list[str]:
    """The flags of this module set on ``config`` (a config or a saved config's dict), as written."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    used = [f"--{k.replace('_', '-')}" for k in ("rotary_interleaved", "attention_output_gate") if get(k)]
    used += [f"--{k.replace('_', '-')} {get(k)}" for k in ("softmax_scale", "no_rope_freq") if get(k) is not None]
    return used


def check_attention_fields(config) -> None:
    """Validate the four flags of a TransformerConfig (one line naming the flag and the fix)."""
    scale = config.softmax_scale
    _require(scale is None or scale > 0, f"--softmax-scale must be positive, got {scale}")
    if config.multi_latent_attention:
        used = attention_flags_in_use(config)
        _require(not used, f"{used[0] if used else ''} does not apply to --multi-latent-attention (Megatron-LM's MLA "
                 "takes its scale from its YaRN settings and rotates its own rotary part); drop it")
    _require(not config.rotary_interleaved or config.position_embedding_type == "rope",
             "--rotary-interleaved needs --position-embedding-type rope (it sets the rotary embedding's layout)")
    freq = config.no_rope_freq
    if freq is None:
        return
    try:
        no_rope_layers(freq, config.num_layers)
    except ValueError as err:
        raise ConfigError(f"--no-rope-freq {freq}: {err}") from None
    _require(config.position_embedding_type == "rope", f"--no-rope-freq {freq} needs --position-embedding-type rope "
             "(it picks the layers without the rotary embedding)")
    _require(not config.mtp_num_layers, f"--no-rope-freq {freq} with --mtp-num-layers: which layers of the "
             "multi-token prediction block skip the rotary embedding is not defined; drop one of them")
