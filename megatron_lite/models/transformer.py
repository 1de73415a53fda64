"""Pre-norm transformer layer and the stack of layers (shared by GPT and BERT).

A layer is ``x + drop(attn(norm(x)))`` then ``x + drop(mlp(norm(x)))``, its parts built from a
:class:`~megatron_lite.models.spec.LayerSpec`. With ``--apply-residual-connection-post-layernorm``
(Megatron-LM's original BERT order) each add takes the norm's output instead: ``n + drop(attn(n))``
with ``n = norm(x)``, then the same around the MLP; the final norm stays. Activations between layers
are ``[s, b, h]``, or the sequence shard ``[s/tp, b, h]`` under sequence parallelism: the norms,
dropout and residual adds then run on the shard; the QKV / fc1 ColumnParallelLinear all-gathers the
sequence and the proj / fc2 RowParallelLinear reduce-scatters it back. With ``--fp32-residual-connection`` the stream
between layers (from the embedding on) is fp32 and each residual add is computed in fp32, while a
norm returns the model's 16-bit dtype, in which the attention and MLP compute.

``TransformerBlock`` holds the global layers ``[layer_start, layer_end)`` of one pipeline chunk,
the final norm when it is the last chunk, and activation recomputation (``config.recompute_*``):

* ``full`` + ``uniform``: checkpoint consecutive groups of ``recompute_num_layers`` layers;
* ``full`` + ``block``: checkpoint each of the first ``recompute_num_layers`` layers of this chunk;
* ``selective``: in every layer, recompute the parts ``--recompute-modules`` names (default core
  attention: QK^T, softmax, dropout, @V; see :mod:`megatron_lite.parallel.recompute`).

All go through :func:`megatron_lite.parallel.random.checkpoint`, which replays dropout exactly.
"""

from __future__ import annotations

import torch
from torch import nn

from ..fusions.dropout import dropout
from ..fusions.residual import bias_dropout_add
from ..moe.layer import MoELayer
from ..parallel.random import checkpoint
from ..parallel.recompute import recompute_modules, run_discarding
from .common import in_dtype, residual_compute_dtype
from .spec import resolve_spec

ATTN_MASK_TYPES = ("causal", "padding")


def hidden_dropout(x: torch.Tensor, p: float, training: bool, tracker=None) -> torch.Tensor:
    """Dropout on the residual branch: the default stream, or the ``tracker``'s TP stream under
    sequence parallelism, where each TP rank holds a different chunk and must not repeat its
    neighbours' mask."""
    if p == 0 or not training:
        return x
    if tracker is not None:
        with tracker.fork():
            return dropout(x, p)
    return dropout(x, p)


class TransformerLayer(nn.Module):
    sharding_unit = True  # ZeRO-3 gathers and frees each layer's parameters as one unit (parallel/fsdp.py)

    def __init__(self, config, state, layer_number: int, spec):
        """``layer_number`` is global and 1-based (it seeds the weights and scales nothing else)."""
        super().__init__()
        self.layer_number = layer_number
        # a part whose spec is None is left out (a hybrid model's layers: attention / Mamba only, or MLP only)
        attention, mlp = spec.self_attention is not None, spec.mlp is not None
        self.input_norm = spec.input_norm(config, state, layer_number) if attention else None
        self.self_attention = (spec.self_attention(config, state, layer_number, core_attention=spec.core_attention)
                               if attention else None)
        self.pre_mlp_norm = spec.pre_mlp_norm(config, state, layer_number) if mlp else None
        self.mlp = spec.mlp(config, state, layer_number) if mlp else None
        self.dropout_p = config.hidden_dropout
        self.dropout_tracker = state.rng_tracker if config.sequence_parallel else None
        self.bias_dropout_fusion = config.bias_dropout_fusion
        self.residual_post_norm = config.apply_residual_connection_post_layernorm
        self.compiled_forward = None  # set by compile_layers
        modules, moe = recompute_modules(config), isinstance(self.mlp, MoELayer)
        self.recompute_norms = "layernorm" in modules
        self.recompute_mlp = ("moe" if moe else "mlp") in modules
        self.tracker = state.rng_tracker
        self.compute_dtype = residual_compute_dtype(config)  # a norm's output: what the layer's GEMMs take

    def forward(self, hidden, attention_mask=None, rotary=None, causal: bool = True, inference_context=None):
        if self.compiled_forward is not None and inference_context is None:  # --torch-compile: one compiled
            if torch.is_grad_enabled() and not hidden.requires_grad:  # function for every layer: Dynamo guards on
                hidden = hidden.detach().requires_grad_()  # requires_grad, False after a frozen embedding (LoRA)
            return self.compiled_forward(self, hidden, attention_mask, rotary, causal)
        return self._forward(hidden, attention_mask, rotary, causal, inference_context)

    def _forward(self, hidden, attention_mask=None, rotary=None, causal: bool = True, inference_context=None):
        """``inference_context``: the key/value cache of decoding, for attention (runs eagerly: its
        lengths change every step)."""
        if self.self_attention is not None:
            x, norm = self._norm(self.input_norm, hidden)
            attn = self.self_attention(x, attention_mask, rotary, causal, inference_context=inference_context)
            hidden = self._add(attn, hidden, x, norm)
        if self.mlp is None:
            return hidden
        x, norm = self._norm(self.pre_mlp_norm, hidden)
        if self.recompute_mlp and torch.is_grad_enabled():  # --recompute-modules mlp (dense) / moe
            out = checkpoint(self._mlp_views, x, tracker=self.tracker)
        else:
            out = self.mlp(x)
        return self._add(out, hidden, x, norm)

    def _add(self, out, hidden, normed, norm):
        """The residual add after a sub-module: ``hidden + dropout(out)``, or with
        ``--apply-residual-connection-post-layernorm`` ``normed + dropout(out)``, ``normed`` being the norm's
        output the sub-module took (in the stream's dtype: fp32 under ``--fp32-residual-connection``).
        ``norm``: the holder of that output under ``--recompute-modules layernorm``, which frees it once
        ``out`` is computed (after the add that reads it) and computes it again in backward."""
        if self.residual_post_norm:
            hidden = self._residual(out, in_dtype(normed, hidden.dtype))
        if norm is not None:
            norm.discard(out[0] if isinstance(out, tuple) else out)
        return hidden if self.residual_post_norm else self._residual(out, hidden)

    def _norm(self, norm, hidden):
        """``(norm(hidden), holder)``: holder is the :class:`~megatron_lite.parallel.recompute.DiscardedOutput`
        to discard after the consumer's forward under ``--recompute-modules layernorm``, else None."""
        if self.recompute_norms and self.training:
            x, holder = run_discarding(norm, hidden)
        else:
            x, holder = norm(hidden), None
        # --fp32-residual-connection: a spec's own norm may return the fp32 stream's dtype (Norm does not)
        return in_dtype(x, self.compute_dtype), holder

    def _mlp_views(self, x):
        """The MLP's output; a bias it leaves to the fused residual is returned as a view (an autograd
        function's output must not be the parameter itself)."""
        out = self.mlp(x)
        if isinstance(out, tuple):
            return tuple(t if t is None else t.view_as(t) for t in out)
        return out

    def _residual(self, out, residual):
        """``residual + dropout(out)``; ``out`` may be ``(output, bias)`` from a sub-module that left its
        bias to be fused here (``--bias-dropout-fusion``)."""
        x, bias = out if isinstance(out, tuple) else (out, None)
        if not self.bias_dropout_fusion:
            x = x if bias is None else x + bias
            return residual + hidden_dropout(x, self.dropout_p, self.training, self.dropout_tracker)
        if self.training and self.dropout_p > 0 and self.dropout_tracker is not None:
            with self.dropout_tracker.fork():
                return bias_dropout_add(x, bias, residual, self.dropout_p, True)
        return bias_dropout_add(x, bias, residual, self.dropout_p, self.training)


class TransformerBlock(nn.Module):
    """Global layers ``[layer_start, layer_end)`` built from ``spec``; the final norm when ``post_process``."""

    def __init__(self, config, state, spec, *, layer_start: int = 0, layer_end: int | None = None,
                 post_process: bool = True, attn_mask_type: str = "causal"):
        super().__init__()
        layer_end = config.num_layers if layer_end is None else layer_end
        if not 0 <= layer_start <= layer_end <= config.num_layers:
            raise ValueError(f"layer range [{layer_start}, {layer_end}) is outside the model's "
                             f"{config.num_layers} layers (--num-layers)")
        if attn_mask_type not in ATTN_MASK_TYPES:
            raise ValueError(f"attn_mask_type {attn_mask_type!r} is not one of {ATTN_MASK_TYPES}")
        self.layer_start, self.layer_end = layer_start, layer_end
        self.causal = attn_mask_type == "causal"
        self.full_recompute = config.recompute_granularity == "full"
        self.recompute_method, self.recompute_num_layers = config.recompute_method, config.recompute_num_layers
        self.tracker = state.rng_tracker
        self.compute_dtype = residual_compute_dtype(config)  # the final norm's output (a spec's norm cast to it)
        self.layers = nn.ModuleList(
            TransformerLayer(config, state, i + 1, resolve_spec(spec, i + 1)) for i in range(layer_start, layer_end)
        )
        # the norm after the last layer: the last layer's spec says which (a spec replacing the norms replaces it too)
        last = config.num_layers
        self.final_norm = resolve_spec(spec, last).final_norm(config, state, last) if post_process else None

    def _run(self, start: int, end: int, inference_context=None):
        """A function running local layers [start, end), for checkpoint (tensors as arguments)."""

        def run(hidden, attention_mask, cos, sin):
            rotary = None if cos is None else (cos, sin)
            for layer in self.layers[start:end]:
                hidden = layer(hidden, attention_mask, rotary, self.causal, inference_context=inference_context)
            return hidden

        return run

    def forward(self, hidden, attention_mask=None, rotary=None, inference_context=None):
        """``inference_context``: the key/value cache of incremental decoding (passed to every
        layer's attention), or None."""
        if inference_context is not None:
            hidden = self._run(0, len(self.layers), inference_context)(hidden, attention_mask, *(rotary or (None, None)))
            return hidden if self.final_norm is None else in_dtype(self.final_norm(hidden), self.compute_dtype)
        cos, sin = rotary if rotary is not None else (None, None)
        n = len(self.layers)
        full = self.full_recompute and torch.is_grad_enabled()
        if full and self.recompute_method == "uniform":
            for start in range(0, n, self.recompute_num_layers):
                end = min(start + self.recompute_num_layers, n)
                hidden = checkpoint(self._run(start, end), hidden, attention_mask, cos, sin, tracker=self.tracker)
        else:
            for i in range(n):
                run = self._run(i, i + 1)
                if full and i < self.recompute_num_layers:  # block: the first N layers of this chunk
                    hidden = checkpoint(run, hidden, attention_mask, cos, sin, tracker=self.tracker)
                else:
                    hidden = run(hidden, attention_mask, cos, sin)
        if self.final_norm is not None:
            hidden = in_dtype(self.final_norm(hidden), self.compute_dtype)
        return hidden


def compile_layers(module: nn.Module, backend: str = "inductor") -> int:
    """Regional ``torch.compile`` (``--torch-compile``, see :mod:`megatron_lite.fusions.compile`): every
    :class:`TransformerLayer` in ``module`` runs one shared compiled forward; the parts that must stay
    eager become graph breaks. Returns the number of layers compiled."""
    from ..fusions.compile import compiled_layer_forward, run_eagerly
    from ..parallel.tensor import DEFAULT_GEMMS, ColumnParallelLinear, RowParallelLinear, linear_gemm

    layers = [m for m in module.modules() if isinstance(m, TransformerLayer)]
    for layer in layers:
        layer.compiled_forward = compiled_layer_forward(TransformerLayer._forward, backend)
        for m in layer.modules():
            if getattr(type(m), "compile_eagerly", False):  # CP attention, MoE
                run_eagerly(m)
            elif isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and m.gemm in DEFAULT_GEMMS:
                m.gemm = linear_gemm  # the accumulating GEMM's backward does data-parallel bookkeeping Dynamo cannot trace
            elif isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
                if isinstance(m.gemm, nn.Module):  # a precision recipe's GEMM (FP8, TE): eager, keeps its state
                    run_eagerly(m.gemm)
                else:
                    m.gemm = torch.compiler.disable(m.gemm)
    return len(layers)
