"""Self-attention: fused QKV projection, optional rotary embedding, core attention, output projection.

Multi-head, grouped-query and multi-query attention share one layout. The fused QKV weight's full
master is ``[groups, (heads_per_group + 2) * head_dim, hidden]`` flattened to 2-D: for each key/value
group, its query heads, then its key head, then its value head. ColumnParallelLinear splits the
rows evenly, so with ``groups % tp == 0`` every rank receives whole groups (its query heads with
the keys/values they use) and attention needs no communication. The output projection is a
RowParallelLinear whose partial sums are all-reduced (or reduce-scattered under SP).

Core attention (softmax(q k^T) v) is its own module, named by the layer spec, so a variant (ring
attention over a context-parallel group, a fused kernel) replaces it without touching the
projections. :class:`DotProductAttention` is ``F.scaled_dot_product_attention`` (causal, or an
explicit boolean mask), or flash-attn's ``flash_attn_func`` when it is importable on a GPU and the
dtype is 16-bit. Packed documents (integer document ids as the mask,
:mod:`~megatron_lite.parallel.document_mask`) become a block-causal boolean mask for SDPA, or the
``cu_seqlens`` of ``flash_attn_varlen_func`` on the flash path. Attention dropout runs inside the TP region (each rank owns different heads) under
the tracker's tensor-parallel generator, so TP ranks draw distinct, reproducible masks.

On the CPU the core attention is :func:`~megatron_lite.models.cpu_attention.cpu_core_attention` with
attention dropout (SDPA's flash kernel has none; ours takes fewer passes than its math path), and
without dropout where :func:`~megatron_lite.models.cpu_attention.beats_cpu_sdpa` says it is the faster
(short causal sequences in a 16-bit dtype the CPU computes in hardware).

Fusion flags: SDPA is the fused scale + mask + softmax (``--masked-softmax-fusion``, on by default);
``--no-masked-softmax-fusion`` runs the explicit math instead (scores, mask, softmax, dropout,
product: one operation each), in the inputs' dtype unless ``--attention-softmax-in-fp32`` casts the
scores to fp32 for the mask and softmax; ``--apply-query-key-layer-scaling`` (fp16 inputs only, as
Megatron's Transformer Engine attention) divides the scores by the layer number in the product and
multiplies them back in that fp32 softmax. The rotary embedding goes through a ``jit_fuser`` function with
``--rope-fusion``. With bias + dropout fusion the output projection returns ``(output, bias)``.

``--qk-layernorm`` (Qwen3, Gemma-3; not OLMo-2, whose norm spans all heads): queries and keys are
normalised per head (``q_layernorm`` / ``k_layernorm``, a ``--normalization`` norm over the head size, one weight shared by
every head) after the QKV projection and before the rotary embedding. The weights are replicated over
TP while each rank normalises only its own heads, so they are marked ``sequence_parallel`` (the
training code sums their gradients over TP) whenever TP > 1, with or without sequence parallelism.
``--qk-l2-norm`` (Llama 4) puts a weightless norm in the same place: each head scaled to unit mean square.

``--rotary-interleaved``, ``--softmax-scale``, ``--attention-output-gate`` and ``--no-rope-freq``:
:mod:`~megatron_lite.models.attention_config` (the gate's heads sit in the fused QKV weight after each
group's query heads: ``[q heads | gate heads | k | v]`` per group).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..activations import L2Norm
from ..device import detect_accelerators
from ..fusions.jit import jit_fuser
from ..inference.kv_cache import causal_mask_with_offset
from ..parallel.attention_sink import sink_logits, softmax_offset
from ..parallel.document_mask import causal_document_mask, cu_seqlens, document_allowed, is_document_ids
from ..parallel.random import checkpoint
from ..parallel.recompute import recompute_modules
from ..parallel.ring_attention import local_attention
from ..parallel.sliding_window import cache_window_mask, confine_to_window
from .attention_config import layer_skips_rope
from .common import Norm, apply_rotary, apply_rotary_interleaved, column_linear, row_linear
from .cpu_attention import beats_cpu_sdpa, cpu_core_attention
from .window_config import layer_window

fused_apply_rotary = jit_fuser(apply_rotary)
fused_apply_rotary_interleaved = jit_fuser(apply_rotary_interleaved)


def rotary_function(config):
    """The rotation of the queries and keys: rotate-half or, with --rotary-interleaved, adjacent pairs;
    through a ``jit_fuser`` function with --rope-fusion."""
    if getattr(config, "rotary_interleaved", False):
        return fused_apply_rotary_interleaved if config.apply_rope_fusion else apply_rotary_interleaved
    return fused_apply_rotary if config.apply_rope_fusion else apply_rotary


def _flash_attn_funcs():
    """flash-attn's (dense, variable-length) functions when usable here (GPU + package), else None."""
    if not detect_accelerators()["flash_attn"]:
        return None
    try:
        from flash_attn import flash_attn_func, flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_func, flash_attn_varlen_func


def _one_head_size(q, k, v):
    """q, k, v zero-padded to one head size (flash-attn's kernels want one): zero channels change
    neither the scores nor the kept output channels."""
    d = max(q.shape[-1], v.shape[-1])
    return tuple(t if t.shape[-1] == d else F.pad(t, (0, d - t.shape[-1])) for t in (q, k, v))


def softmax_scale(config) -> float:
    """The scale of the attention logits: a TransformerConfig's ``attention_scale`` (--softmax-scale, or MLA's), or
    another config's ``softmax_scale``, else 1 / sqrt(head size)."""
    scale = getattr(config, "attention_scale", None)
    scale = getattr(config, "softmax_scale", None) if scale is None else scale
    return scale if scale is not None else 1.0 / math.sqrt(config.head_dim)


class DotProductAttention(nn.Module):
    """softmax(q k^T * scale [+ mask]) v with dropout on the probabilities (the core-attention seam).

    ``forward(q, k [s, b, n, dk], v [s, b, nkv, dv], attention_mask, causal) -> [s, b, nq * dv]``
    with ``nq % nkv == 0`` (each key/value head serves ``nq / nkv`` consecutive query heads) and a
    value head size that may differ from the query/key one (MLA: 192 vs 128); ``attention_mask``
    None, bool ``[b, 1, sq, sk]`` (True = masked out) or int document ids ``[b, s]``. ``scale`` is
    ``1 / sqrt(dk)``, or the config's ``attention_scale`` (--softmax-scale, or MLA's YaRN-corrected one). Keys and values
    may be longer than the queries (decoding with a key/value cache): causal attention is then
    bottom-right aligned, the queries being the last ``s`` positions.
    """

    def __init__(self, config, state, layer_number: int):
        super().__init__()
        self.tracker = state.rng_tracker
        self.dropout_p = config.attention_dropout
        self.scale = softmax_scale(config)
        self.flash = _flash_attn_funcs()  # decided once per layer, at construction
        self.fused_softmax = config.masked_softmax_fusion
        # the unfused path's numerics (Megatron's flags; the fused kernels always soft-max in fp32)
        self.softmax_in_fp32 = getattr(config, "attention_softmax_in_fp32", False)
        self.layer_scaling = layer_number if getattr(config, "apply_query_key_layer_scaling", False) else 1
        self.sliding_window = layer_window(config, layer_number)  # (left, right), or None: the whole context
        self.flash_window = {"window_size": self.sliding_window} if self.sliding_window else {}  # flash-attn's
        self.softmax_type = getattr(config, "softmax_type", "vanilla")  # --softmax-type: parallel/attention_sink.py
        self.softmax_offset = softmax_offset(config, state)  # the learnable sinks of this rank's heads, or None

    def forward(self, q, k, v, attention_mask=None, causal: bool = True):
        p = self.dropout_p if self.training else 0.0
        if p > 0:
            with self.tracker.fork():
                return self._attend(q, k, v, attention_mask, causal, p)
        return self._attend(q, k, v, attention_mask, causal, 0.0)

    def _flash_applies(self, q, attention_mask) -> bool:
        return (self.flash is not None and self.softmax_type == "vanilla"  # flash-attn has no sink
                and (attention_mask is None or is_document_ids(attention_mask))
                and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16))

    def _attend(self, q, k, v, attention_mask, causal, dropout_p):
        s, b, nq = q.shape[:3]
        dv = v.shape[-1]
        documents = is_document_ids(attention_mask)
        if self._flash_applies(q, attention_mask):
            if documents:
                return self._flash_documents(q, k, v, attention_mask, causal, dropout_p)
            q, k, v = _one_head_size(q, k, v)
            out = self.flash[0](q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), dropout_p=dropout_p,
                                softmax_scale=self.scale, causal=causal, **self.flash_window)  # [b, s, nq, d], GQA native
            return out[..., :dv].transpose(0, 1).reshape(s, b, nq * dv)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d]
        if documents:  # SDPA: True = may attend
            ids = attention_mask
            mask = causal_document_mask(ids) if causal else document_allowed(ids, ids)
        else:
            mask = None if attention_mask is None else ~attention_mask
        if causal and mask is None and k.shape[2] != s:  # SDPA's is_causal is top-left aligned
            mask = ~causal_mask_with_offset(s, k.shape[2], q.device)
        window = self.sliding_window  # a dense mask of fewer queries than keys is a cache's, already windowed
        if window is not None and (documents or attention_mask is None or s == k.shape[2]):
            mask = confine_to_window(mask, window, causal, s, k.shape[2], q.device)
        sink = sink_logits(self.softmax_type, self.softmax_offset, nq, q.device)
        if not self.fused_softmax:
            coeff = self.layer_scaling if q.dtype == torch.float16 else 1  # Megatron scales fp16 only
            return unfused_attention(q, k, v, None if mask is None else ~mask, causal, dropout_p, self.scale, sink,
                                     softmax_in_fp32=self.softmax_in_fp32, coeff=coeff)
        if q.device.type == "cpu" and (dropout_p > 0 or beats_cpu_sdpa(q, k, mask, causal)):
            out = cpu_core_attention(q, k, v, None if mask is None else ~mask, causal and mask is None, dropout_p,
                                     self.scale, sink)
        elif sink is not None:  # SDPA has no sink: kernels that report each row's log-sum-exp (ring_attention.py)
            seed = int(torch.randint(0, 2**62, (1,), device=q.device).item()) if dropout_p > 0 else 0  # the tracker's
            out = local_attention(q, k, v, causal and mask is None, self.scale, dropout_p, seed, mask, sink)
        else:  # enable_gqa: key/value head j serves query heads [j * group, (j + 1) * group), without copying k, v
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                                 is_causal=causal and mask is None, scale=self.scale,
                                                 enable_gqa=nq != k.shape[1])
        return out.permute(2, 0, 1, 3).reshape(s, b, nq * dv)

    def _flash_documents(self, q, k, v, ids, causal, dropout_p):
        """flash-attn's variable-length kernel: the batch as one token stream cut at the documents."""
        s, b, nq = q.shape[:3]
        dv = v.shape[-1]
        q, k, v = _one_head_size(q, k, v)
        d = q.shape[-1]
        bounds, longest = cu_seqlens(ids)
        q, k, v = (t.transpose(0, 1).reshape(b * s, t.shape[2], d) for t in (q, k, v))  # [b * s, heads, d]
        out = self.flash[1](q, k, v, bounds, bounds, longest, longest, dropout_p=dropout_p,
                            softmax_scale=self.scale, causal=causal, **self.flash_window)
        return out.reshape(b, s, nq, d)[..., :dv].transpose(0, 1).reshape(s, b, nq * dv)


def unfused_attention(q, k, v, attention_mask, causal: bool, dropout_p: float, scale: float,
                      sink=None, *, softmax_in_fp32: bool = False, coeff: float = 1) -> torch.Tensor:
    """``--no-masked-softmax-fusion``: softmax(q k^T scale + mask) v with one operation per step.
    ``q [b, nq, s, d]``, ``k [b, nkv, s, d]``, ``v [b, nkv, s, dv]``; returns ``[s, b, nq * dv]``.
    ``sink`` (``[nq]`` or None): one more logit per row, in the softmax's denominator only. A query whose
    every key is masked attends to nothing (zeros out, no gradient), as SDPA's kernels and the fused path do,
    not ``softmax`` of a row of -inf (NaN, which ``probs @ v`` then spreads).

    The scale multiplies the product's accumulator (``baddbmm``'s alpha), so 16-bit scores are rounded
    once and overflow only where the scaled score does. ``softmax_in_fp32`` (``--attention-softmax-in-fp32``):
    the scores are cast to fp32 before the mask and the softmax, the probabilities rounded to the input's
    dtype once after it; otherwise both run in the input's dtype. ``coeff`` (``--apply-query-key-layer-scaling``
    under fp16: the layer number) divides the scale, keeping fp16 scores ``coeff`` times further from
    overflow, and multiplies the fp32 scores back before the softmax (it needs ``softmax_in_fp32``)."""
    b, nq, s, dv = *q.shape[:3], v.shape[-1]
    if coeff != 1 and not softmax_in_fp32:
        raise ValueError("query-key layer scaling (coeff != 1) undoes its scale in an fp32 softmax: "
                         "pass softmax_in_fp32=True")
    if k.shape[1] != nq:  # grouped-query attention: each key/value head serves nq / nkv query heads
        k, v = (t.repeat_interleave(nq // k.shape[1], dim=1) for t in (k, v))
    sk, d = k.shape[2], q.shape[-1]
    scores = torch.baddbmm(q.new_zeros(()), q.reshape(b * nq, s, d), k.reshape(b * nq, sk, d).transpose(1, 2),
                           beta=0, alpha=scale / coeff).view(b, nq, s, sk)
    if softmax_in_fp32:
        scores = scores.float() if coeff == 1 else scores.float() * coeff
    if attention_mask is not None:
        scores = scores.masked_fill(attention_mask, float("-inf"))
    elif causal:
        above = torch.ones(s, k.shape[2], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(above, float("-inf"))
    if sink is None:
        probs = torch.softmax(scores, dim=-1)
    else:  # the sink's column joins the softmax and is dropped after it
        column = sink.to(scores.dtype).view(1, nq, 1, 1).expand(b, nq, s, 1)
        probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    if attention_mask is not None:  # a row of -inf: softmax's NaN becomes 0 (the gradient's masked_fill zeroes it)
        probs = probs.masked_fill(attention_mask.all(-1, keepdim=True), 0.0)
    probs = probs.to(v.dtype)  # softmax_in_fp32: the one rounding of the probabilities
    probs = F.dropout(probs, p=dropout_p, training=dropout_p > 0)
    return torch.matmul(probs, v).permute(2, 0, 1, 3).reshape(s, b, nq * dv)


def rotate_part(rotate, x, cos, sin):
    """``rotate`` (plain or fused rotary) on the first ``cos.shape[-1]`` channels of each head of ``x``
    (all of them unless --rotary-percent is below 1); the other channels pass through unchanged."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return rotate(x, cos, sin)
    return torch.cat([rotate(x[..., :r], cos, sin), x[..., r:]], dim=-1)


def head_norm(config, state) -> Norm:
    """``--qk-layernorm``'s norm over one head's channels: replicated, each TP rank sees only its own
    heads, so its gradient is summed over TP (the ``sequence_parallel`` mark) whenever TP > 1."""
    return Norm(config.head_dim, config.normalization, config.norm_epsilon, sequence_parallel=state.tp_size > 1,
                dtype=config.params_dtype, zero_centered=config.apply_layernorm_1p)


class SelfAttention(nn.Module):
    """QKV projection -> (rotary) -> core attention -> output projection.

    ``core_attention`` is the spec's factory ``(config, state, layer_number) -> module``.
    """

    def __init__(self, config, state, layer_number: int, *, core_attention=DotProductAttention):
        super().__init__()
        tp = state.tp_size
        heads, groups = config.num_attention_heads, config.num_query_groups
        self.head_dim = config.head_dim
        self.heads_per_group = heads // groups
        self.local_groups = groups // tp
        self.selective_recompute = "core_attn" in recompute_modules(config)
        self.tracker = state.rng_tracker
        self.layer_number = layer_number
        self.gated = bool(getattr(config, "attention_output_gate", False))  # per group: [q | gate | k | v] heads
        qkv_size = (heads * (2 if self.gated else 1) + 2 * groups) * self.head_dim
        self.linear_qkv = column_linear(config, state, layer_number, qkv_size, "self_attention.linear_qkv",
                                        bias=config.add_bias_linear or config.add_qkv_bias)
        self.core_attention = core_attention(config, state, layer_number)
        self.linear_proj = row_linear(config, state, layer_number, heads * self.head_dim, "self_attention.linear_proj",
                                      skip_bias_add=config.bias_dropout_fusion)
        self.rotate = rotary_function(config)
        self.skips_rope = layer_skips_rope(config, layer_number)  # --no-rope-freq: a NoPE layer
        self.q_layernorm, self.k_layernorm = (head_norm(config, state) for _ in range(2)) if config.qk_layernorm \
            else (None, None)
        if getattr(config, "qk_l2_norm", False):  # no weights (megatron_lite/activations.py)
            self.q_layernorm = self.k_layernorm = L2Norm(config.norm_epsilon)

    def forward(self, hidden, attention_mask=None, rotary=None, causal: bool = True, inference_context=None):
        """``hidden [s(/tp), b, h]`` -> ``[s(/tp), b, h]`` (``(output, bias)`` with bias + dropout fusion, the
        bias left to the layer); ``rotary`` is (cos, sin) ``[s, b, 1, d]`` or None.

        With ``inference_context`` (a :class:`~megatron_lite.inference.KVCache`) the new tokens' keys
        and values (this rank's key/value heads only) are appended to the cache and the queries
        attend over everything cached."""
        qkv = self.linear_qkv(hidden)  # [s, b, local_groups * (hpg (x 2 gated) + 2) * d]
        s, b = qkv.shape[:2]
        hpg = self.heads_per_group
        gates = hpg if self.gated else 0
        qkv = qkv.view(s, b, self.local_groups, hpg + gates + 2, self.head_dim)
        q, gate, k, v = qkv.split([hpg, gates, 1, 1], dim=3)
        q = q.reshape(s, b, self.local_groups * hpg, self.head_dim)
        k, v = k.squeeze(3), v.squeeze(3)
        if self.q_layernorm is not None:  # per head, before the rotary embedding (Qwen3's order)
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if rotary is not None and not self.skips_rope:
            cos, sin = (t.to(q.dtype) for t in rotary)
            q, k = rotate_part(self.rotate, q, cos, sin), rotate_part(self.rotate, k, cos, sin)
        if inference_context is not None:
            k, v = inference_context.append(self.layer_number, k, v)
            window = getattr(self.core_attention, "sliding_window", None)
            attention_mask = cache_window_mask(inference_context, attention_mask, window, s, k.shape[0], q.device)
        if self.selective_recompute and torch.is_grad_enabled():
            context = checkpoint(self.core_attention, q, k, v, attention_mask, causal, tracker=self.tracker)
        else:
            context = self.core_attention(q, k, v, attention_mask, causal)
        if self.gated:  # --attention-output-gate: sigmoid in fp32, the product rounded once
            context = (context * torch.sigmoid(gate.reshape(context.shape).float())).to(context.dtype)
        return self.linear_proj(context)

