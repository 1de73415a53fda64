"""Training FLOPs of a GPT per iteration and model FLOPs utilisation (this machine's matmul peak:
:mod:`.matmul_peak`).

The count is Narayanan et al. (2021): only matrix multiplications are counted (norms, softmax,
activations and the optimizer are noise at these sizes), a multiply-add is 2 FLOPs, and the
backward pass costs twice the forward. For batch B, sequence s, hidden h, layers l, vocabulary V and
a 4h GeLU MLP with multi-head attention, one layer's forward is

    QKV projection 6·B·s·h²  +  scores Q·Kᵀ 2·B·s²·h  +  probabilities·V 2·B·s²·h
    +  output projection 2·B·s·h²  +  MLP 2·2·B·s·h·4h  =  24·B·s·h² + 4·B·s²·h

and the logits add 2·B·s·h·V. Three times that (forward + backward) gives the paper's closed form

    72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)),

and with full activation recomputation every layer's forward runs twice (the logits are not
recomputed): 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)).

Generalisation (each term computed from the actual shapes, so it reduces to the formula above):

* attention with ``a`` heads of ``d`` channels (``kv_channels``) and ``g`` key/value groups (GQA/MQA):
  Q projection 2·B·s·h·a·d, K and V projections 2·2·B·s·h·g·d, scores and values 2·2·B·s²·a·d,
  output projection 2·B·s·a·d·h. The causal mask is not discounted (as in the paper and Megatron);
  ``--attention-output-gate`` doubles the Q projection (its gate heads; the elementwise gate is not counted);
* sliding-window attention (``--window-size LEFT RIGHT``, per layer as ``--window-attn-skip-freq``
  chooses): a windowed layer's queries each count the ``w = LEFT + 1 + RIGHT`` keys their window
  spans (at most s; a side of -1 is unbounded), so its scores and values are 2·2·B·s·w·a·d where a
  full layer's are 2·2·B·s²·a·d (the mask not discounted either: a causal window counts LEFT + 1);
* MLP with hidden ``f`` (``ffn_hidden_size``): up 2·B·s·h·f (twice that for SwiGLU's gate and up
  halves) + down 2·B·s·f·h;
* V is the padded vocabulary when known (the size actually multiplied), else ``vocab_size``;
* mixture of experts (``moe_config`` with ``num_experts``): in the layers ``moe_layer_freq`` selects
  the MLP is replaced by the router 2·B·s·h·E, the ``moe_router_topk`` experts each token visits
  (the MLP formula with ``moe_ffn_hidden_size``, k times) and the shared experts (the MLP formula
  with ``moe_shared_expert_intermediate_size``): only the *active* parameters count;
* multi-latent attention (``multi_latent_attention``; ``a`` heads, ``dn`` / ``dr`` / ``dv`` the
  qk / rotary / value head sizes, ``rq`` / ``rkv`` the ranks): queries 2·B·s·h·a·(dn+dr) without
  compression, else 2·B·s·rq·(h + a·(dn+dr)); key/value latent and rotary key 2·B·s·h·(rkv+dr);
  latent expansion 2·B·s·rkv·a·(dn+dv); scores 2·B·s²·a·(dn+dr) and values 2·B·s²·a·dv; output
  2·B·s·a·dv·h (Megatron-LM's count, with the norms left out and the causal mask not discounted);
* multi-token prediction (``mtp_num_layers`` D): D more layers of the last layer's kind, D
  projections 2·B·s·2h·h and D more logits (the layers recomputed with full recomputation, the
  projections and logits not);
* hybrid Mamba models (``--hybrid-override-pattern`` ...): each layer counts its one part, an
  attention layer the attention above, an MLP layer the MLP, a Mamba layer (``d`` = heads x head dim,
  ``G`` groups, ``N`` state, ``H`` heads) in_proj 2·B·s·h·(2d + 2GN + H), out_proj 2·B·s·d·h and the
  scan's state update and read-out 2·2·B·s·d·N (the recurrence's multiply-adds; the chunked form's
  extra intra-chunk products and the conv1d are not counted).

MFU uses the model FLOPs (``recompute_full=False``) whatever the run recomputes.
"""

from __future__ import annotations

from ..models.mamba_config import ATTENTION, MAMBA, hybrid_layers, is_hybrid, mamba_sizes
from ..models.window_config import layer_window
from ..moe.layer_pattern import parse_moe_layer_freq


def _get(config, name, default=None):
    value = getattr(config, name, None)
    return default if value is None else value


def mlp_flops(tokens: int, hidden: int, ffn: int, swiglu: bool) -> float:
    """Forward FLOPs of one MLP: up (twice for SwiGLU's gate and up halves) and down projections."""
    return float(2 * tokens * hidden * ffn * (2 if swiglu else 1) + 2 * tokens * ffn * hidden)


def moe_mlp_flops(model_config, moe_config, batch_size: int) -> float:
    """Forward FLOPs of an MoE layer's MLP part: router, the top-k routed experts, shared experts."""
    h, tokens = model_config.hidden_size, batch_size * model_config.seq_length
    swiglu = _get(model_config, "swiglu", False) or _get(model_config, "quick_geglu", False)  # gated: 2 x fc1
    ffn = _get(moe_config, "moe_ffn_hidden_size", _get(model_config, "ffn_hidden_size", 4 * h))
    flops = 2 * tokens * h * moe_config.num_experts + moe_config.moe_router_topk * mlp_flops(tokens, h, ffn, swiglu)
    shared = _get(moe_config, "moe_shared_expert_intermediate_size")
    return flops + (mlp_flops(tokens, h, shared, swiglu) if shared else 0.0)


def attended_keys(model_config, window=None) -> int:
    """Keys each query is counted against: the sequence length, or the width of its ``window``
    ``(left, right)`` (at most the sequence length; -1 leaves a side unbounded)."""
    s = model_config.seq_length
    if window is None:
        return s
    left, right = (s if side < 0 else side for side in window)
    return min(s, left + 1 + right)


def core_attention_flops(model_config, batch_size: int, window=None) -> float:
    """Forward FLOPs of one layer's Q·Kᵀ and probabilities·V (what selective recomputation repeats);
    ``window`` ``(left, right)``: that layer's sliding window (None: full attention)."""
    h, s = model_config.hidden_size, model_config.seq_length
    keys = attended_keys(model_config, window)
    heads = model_config.num_attention_heads
    if _get(model_config, "multi_latent_attention", False):
        qk = model_config.qk_head_dim + model_config.qk_pos_emb_head_dim
        return float(2 * batch_size * s * keys * heads * (qk + model_config.v_head_dim))
    d = _get(model_config, "kv_channels", h // heads)
    return float(2 * 2 * batch_size * s * keys * heads * d)


def layer_windows(model_config) -> list:
    """The sliding window of every layer, multi-token prediction layers last (None: full attention)."""
    total = model_config.num_layers + _get(model_config, "mtp_num_layers", 0)
    return [layer_window(model_config, n) for n in range(1, total + 1)]


def _mla_projection_flops(model_config, tokens: int) -> float:
    """Forward FLOPs of MLA's projections (queries, latent, expansion, output) for ``tokens`` tokens."""
    c, h = model_config, model_config.hidden_size
    a, qk, dv = c.num_attention_heads, c.qk_head_dim + c.qk_pos_emb_head_dim, c.v_head_dim
    queries = 2 * tokens * h * a * qk if c.q_lora_rank is None else 2 * tokens * c.q_lora_rank * (h + a * qk)
    latent = 2 * tokens * h * (c.kv_lora_rank + c.qk_pos_emb_head_dim)
    expansion = 2 * tokens * c.kv_lora_rank * a * (c.qk_head_dim + dv)
    return float(queries + latent + expansion + 2 * tokens * a * dv * h)


def attention_flops(model_config, batch_size: int, window=None) -> float:
    """Forward matmul FLOPs of one layer's attention block (projections and core attention)."""
    h = model_config.hidden_size
    s = model_config.seq_length
    heads = model_config.num_attention_heads
    d = _get(model_config, "kv_channels", h // heads)
    groups = _get(model_config, "num_query_groups", heads)
    tokens = batch_size * s
    if _get(model_config, "multi_latent_attention", False):
        attention = _mla_projection_flops(model_config, tokens) + core_attention_flops(model_config, batch_size, window)
    else:
        attention = (
            2 * tokens * h * heads * d * (2 if _get(model_config, "attention_output_gate", False) else 1)  # Q (+ gate)
            + 2 * 2 * tokens * h * groups * d  # K and V projections
            + core_attention_flops(model_config, batch_size, window)  # Q·Kᵀ and probabilities·V
            + 2 * tokens * heads * d * h  # output projection
        )
    return float(attention)


def mamba_flops(model_config, batch_size: int) -> float:
    """Forward FLOPs of one Mamba layer: in_proj, out_proj and the scan's recurrence (module docstring)."""
    d, heads, _, groups, n = mamba_sizes(model_config)
    tokens, h = batch_size * model_config.seq_length, model_config.hidden_size
    return float(2 * tokens * h * (2 * d + 2 * groups * n + heads) + 2 * tokens * d * h + 2 * 2 * tokens * d * n)


def dense_mlp_flops(model_config, batch_size: int) -> float:
    """Forward FLOPs of one layer's dense MLP."""
    h, tokens = model_config.hidden_size, batch_size * model_config.seq_length
    ffn = _get(model_config, "ffn_hidden_size", 4 * h)
    return mlp_flops(tokens, h, ffn, _get(model_config, "swiglu", False) or _get(model_config, "quick_geglu", False))


def forward_flops_per_layer(model_config, batch_size: int, moe_config=None, window=None) -> float:
    """Forward matmul FLOPs of one transformer layer for ``batch_size`` sequences (an MoE layer when
    ``moe_config`` is given; ``window``: its sliding window, None for full attention)."""
    attention = attention_flops(model_config, batch_size, window)
    if moe_config is not None:
        return attention + moe_mlp_flops(model_config, moe_config, batch_size)
    return attention + dense_mlp_flops(model_config, batch_size)


def hybrid_layer_flops(model_config, batch_size: int) -> float:
    """Forward FLOPs of a hybrid model's layers, each counted by its kind (M, * or -)."""
    per_kind = {MAMBA: mamba_flops(model_config, batch_size), ATTENTION: attention_flops(model_config, batch_size),
                "-": dense_mlp_flops(model_config, batch_size)}
    return sum(per_kind[kind] for kind in hybrid_layers(model_config))


def logits_flops(model_config, batch_size: int) -> float:
    """Forward FLOPs of the output layer (hidden -> vocabulary)."""
    vocab = _get(model_config, "padded_vocab_size", _get(model_config, "vocab_size"))
    if vocab is None:
        raise ValueError("the model config has neither padded_vocab_size nor vocab_size; pass --vocab-size or a --tokenizer-type")
    return float(2 * batch_size * model_config.seq_length * model_config.hidden_size * vocab)


def num_floating_point_operations(model_config, batch_size: int, recompute_full: bool = False,
                                  moe_config=None) -> float:
    """Training FLOPs (forward + backward) of one iteration over ``batch_size`` sequences.

    ``batch_size`` is the global batch (all micro-batches and data-parallel ranks); divide by the
    number of devices for a per-device figure. ``recompute_full`` adds the recomputed forward of
    every layer (hardware FLOPs of ``--recompute-granularity full``). ``moe_config`` (the MoE flags)
    makes the layers ``moe_layer_freq`` selects MoE layers; ``model_config``'s ``window_size`` and
    ``window_attn_skip_freq`` the sliding-window ones.
    """
    layer_passes = 4 if recompute_full else 3
    mtp = _get(model_config, "mtp_num_layers", 0)
    pattern = [False] * model_config.num_layers
    if moe_config is not None and _get(moe_config, "num_experts"):
        pattern = parse_moe_layer_freq(moe_config.moe_layer_freq, model_config.num_layers)
    pattern = pattern + pattern[-1:] * mtp  # multi-token prediction: layers of the last layer's kind
    kinds = list(zip(pattern, layer_windows(model_config)))  # (MoE?, sliding window) of every layer
    per_kind = {kind: forward_flops_per_layer(model_config, batch_size, moe_config if kind[0] else None, kind[1])
                for kind in set(kinds)}
    layers = sum(per_kind[kind] for kind in kinds)
    if is_hybrid(model_config):  # (no MoE, MTP or sliding windows in hybrid models)
        layers = hybrid_layer_flops(model_config, batch_size)
    tokens, h = batch_size * model_config.seq_length, model_config.hidden_size
    mtp_projections = mtp * 2 * tokens * 2 * h * h
    return layer_passes * layers + 3 * (mtp_projections + (1 + mtp) * logits_flops(model_config, batch_size))


def spec_formula(batch_size: int, seq: int, layers: int, hidden: int, vocab: int, recompute_full=False) -> float:
    """The closed form of the module docstring, 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)) (96 and V/(16·l·h)
    with full recomputation), valid for MHA and a 4h GeLU MLP; for checking the general count."""
    B, s, l, h, V = batch_size, seq, layers, hidden, vocab
    if recompute_full:
        return 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    return 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))


def mfu(flops_per_s: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s as a fraction of the device's peak."""
    if peak_flops <= 0:
        raise ValueError(f"peak FLOP/s must be positive, got {peak_flops}")
    return flops_per_s / peak_flops
