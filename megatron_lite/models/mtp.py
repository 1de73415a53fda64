"""Multi-token prediction (MTP, DeepSeek-V3): extra layers on the last stage that predict further ahead.

Depth ``k = 1..D`` (``--mtp-num-layers D``) at position ``i`` predicts token ``t(i+k+1)``. Its input
is the previous depth's output ``h(k-1)`` (depth 0: the decoder's output after its final norm) and
the embedding of token ``t(i+k)`` (the shared word embedding):

    x = eh_proj([enorm(embed(t(i+k))) ; hnorm(h(k-1))])      (2h -> h, embedding first)
    h(k) = final_layernorm(transformer_layer(x))              (same positions, rotary and mask)
    loss(k) = CE(output_layer(h(k)), t(i+k+1)) where mask(i+k)

and the training objective is ``lm loss + mtp_loss_scaling_factor / D x sum_k mean loss(k)``; each
depth's mean is reported as ``mtp_k loss`` (not added to ``lm loss``). The shifted inputs, labels and
loss masks come from :func:`mtp_targets`, computed on the whole sequence before the
context-parallel split (so no rank needs its neighbour's tokens); like Megatron-LM's cumulative
roll, the last ``k`` positions of depth ``k`` hold token 0 and loss-mask 0.

``transformer_layer`` is built from the last decoder layer's spec (MLA / MoE / dense alike) with
global layer number ``num_layers + k`` (it seeds its weights; an MoE router logs its losses under
that layer). The norms follow the same spec: ``enorm`` and ``hnorm`` are its ``input_norm``,
``final_layernorm`` its ``final_norm`` (each ``factory(config, state, num_layers + k)``), so a spec
replacing the norms (``examples/research/dyt.py``) replaces MTP's too. Parameters (Megatron's names: ``mtp.layers.{k-1}.{enorm,hnorm,eh_proj,transformer_layer,
final_layernorm}``): ``enorm`` / ``hnorm`` / ``final_layernorm`` replicated over TP (summed over TP
under sequence parallelism), ``eh_proj.weight [h, 2h]`` column-parallel (rows split over TP, no
bias); its output is all-gathered over TP (and scattered back to the sequence shard under SP).

Under pipeline parallelism MTP lives on the last stage, which holds a copy of the word embedding
shared with the first stage (:class:`~megatron_lite.models.language_model.LanguageModel`). Without
labels (generation) or in evaluation MTP does not run, except as speculative decoding's drafter
(:mod:`megatron_lite.inference.speculative`, through :meth:`~megatron_lite.models.gpt.GPTModel.mtp_decode`):
each depth then runs with a key/value cache of its own.
"""

from __future__ import annotations

import torch
from torch import nn

from ..parallel import comm
from ..parallel.random import checkpoint
from .common import column_linear, in_dtype, residual_compute_dtype
from .spec import resolve_spec
from .transformer import TransformerLayer


def roll_left(t: torch.Tensor, k: int) -> torch.Tensor:
    """``t [..., s]`` shifted left by ``k`` positions, the last ``k`` filled with zeros."""
    out = torch.zeros_like(t)
    if k < t.shape[-1]:
        out[..., : t.shape[-1] - k] = t[..., k:]
    return out


def mtp_targets(tokens: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor, depth: int) -> dict:
    """``{"mtp_tokens", "mtp_labels", "mtp_loss_mask"}``, each ``[D, b, s]``: row ``k - 1`` is the
    batch's tokens / labels / loss mask ``[b, s]`` shifted left by ``k`` (zero-filled)."""
    def stack(t):
        return torch.stack([roll_left(t, k) for k in range(1, depth + 1)])

    return {"mtp_tokens": stack(tokens), "mtp_labels": stack(labels), "mtp_loss_mask": stack(loss_mask)}


class MultiTokenPredictionLayer(nn.Module):
    """One depth ``k``: norms, the 2h -> h projection, a transformer layer and its final norm."""

    def __init__(self, config, state, depth: int, spec):
        super().__init__()
        layer_number = config.num_layers + depth
        self.tp_group, self.sequence_parallel = state.tp_group, config.sequence_parallel
        # the norms follow the spec: enorm / hnorm are input norms, final_layernorm the norm before the output
        self.enorm = spec.input_norm(config, state, layer_number)
        self.hnorm = spec.input_norm(config, state, layer_number)
        self.eh_proj = column_linear(config, state, layer_number, config.hidden_size, "mtp.eh_proj",
                                     input_size=2 * config.hidden_size, bias=False)
        self.transformer_layer = TransformerLayer(config, state, layer_number, spec)
        self.final_layernorm = spec.final_norm(config, state, layer_number)
        self.recompute = config.recompute_granularity == "full"
        self.tracker = state.rng_tracker
        self.compute_dtype = residual_compute_dtype(config)

    def forward(self, hidden, embedded, attention_mask=None, rotary=None, causal: bool = True, inference_context=None):
        """``hidden``, ``embedded`` ``[s(/tp), b, h]`` -> this depth's normed output ``[s(/tp), b, h]``;
        ``inference_context``: this depth's own key/value cache (speculative decoding), or None."""
        dtype = self.compute_dtype  # a spec's norms of --fp32-residual-connection's fp32 inputs: cast
        x = self.eh_proj(torch.cat([in_dtype(self.enorm(embedded), dtype), in_dtype(self.hnorm(hidden), dtype)],
                                   dim=-1))  # [s, b, h/tp]
        x = comm.gather_from_tp(x, self.tp_group)
        if self.sequence_parallel:
            x = comm.scatter_to_sp(x, self.tp_group)
        if inference_context is not None:
            x = self.transformer_layer(x, attention_mask, rotary, causal, inference_context=inference_context)
        elif self.recompute and torch.is_grad_enabled():  # full recompute: the layer, like the decoder's
            cos, sin = rotary if rotary is not None else (None, None)
            x = checkpoint(self._layer, x, attention_mask, cos, sin, causal, tracker=self.tracker)
        else:
            x = self.transformer_layer(x, attention_mask, rotary, causal)
        return self.final_layernorm(x)

    def _layer(self, x, attention_mask, cos, sin, causal):
        return self.transformer_layer(x, attention_mask, None if cos is None else (cos, sin), causal)


class MultiTokenPredictionBlock(nn.Module):
    """The ``D`` depths; ``spec`` is the model's layer spec (one, or per layer: the last layer's is used)."""

    def __init__(self, config, state, spec):
        super().__init__()
        last = resolve_spec(spec, config.num_layers)
        self.layers = nn.ModuleList(MultiTokenPredictionLayer(config, state, k + 1, last)
                                    for k in range(config.mtp_num_layers))

    def forward(self, hidden, mtp_tokens, embed, attention_mask=None, rotary=None, causal: bool = True):
        """Each depth's output ``[s(/tp), b, h]``; ``mtp_tokens [D, b, s]``, ``embed(tokens [b, s])``
        the word embedding."""
        outputs = []
        for k, layer in enumerate(self.layers):
            hidden = layer(hidden, embed(mtp_tokens[k]), attention_mask, rotary, causal)
            outputs.append(hidden)
        return outputs
