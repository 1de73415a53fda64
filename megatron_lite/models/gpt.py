"""GPT: embedding -> pre-norm transformer layers -> final norm -> output layer -> loss.

Reads like a single-device GPT; the tensor-parallel layers and the two collectives around the
output layer are the only difference. One ``GPTModel`` holds one pipeline chunk: global layers
``[layer_start, layer_end)``, plus the embedding when ``pre_process`` (first stage) and the final
norm, output layer and loss when ``post_process`` (last stage). The embedding, the vocab-parallel
output layer, weight tying across pipeline stages and the pipeline hooks are shared with BERT
(:class:`~megatron_lite.models.language_model.LanguageModel`, where they are explained).

The layers come from a layer spec (:func:`~megatron_lite.models.spec.gpt_layer_spec` unless one is
passed), so attention, MLP and norms can be swapped without touching this file. With
``--mtp-num-layers`` the last stage also holds the multi-token prediction block
(:mod:`~megatron_lite.models.mtp`) and, without the first stage's embedding, a copy of it.
"""

from __future__ import annotations

import torch

from .language_model import LanguageModel
from .mtp import MultiTokenPredictionBlock
from .spec import gpt_layer_spec
from .transformer import TransformerBlock


class GPTModel(LanguageModel):
    """One pipeline chunk of a GPT: ``config`` is a :class:`~megatron_lite.models.transformer_config.TransformerConfig`."""

    def __init__(self, config, state, *, spec=None, pre_process: bool = True, post_process: bool = True,
                 layer_start: int = 0, layer_end: int | None = None):
        mtp = bool(getattr(config, "mtp_num_layers", None)) and post_process
        super().__init__(config, state, pre_process=pre_process, post_process=post_process,
                         layer_start=layer_start, layer_end=layer_end, embedding=pre_process or mtp)
        spec = spec if spec is not None else gpt_layer_spec(config)
        self.decoder = TransformerBlock(config, state, spec, layer_start=layer_start, layer_end=layer_end,
                                        post_process=post_process, attn_mask_type="causal")
        self.mtp = MultiTokenPredictionBlock(config, state, spec) if mtp else None
        if post_process:
            self._build_output_layer(bias=False)
        self._mark_shared_weight()

    def forward(self, tokens, position_ids=None, attention_mask=None, labels=None, inference_context=None, *,
                mtp_tokens=None, mtp_labels=None, return_hidden: bool = False):
        """See the module docstring; shapes: tokens/position_ids/labels ``[b, s]``, mask bool
        ``[b, 1, s, s]`` or int document ids ``[b, s]``.

        Returns the per-token loss ``[b, s]`` (last stage with labels), the logits shard
        ``[b, s, padded_vocab/tp]`` (last stage without labels) or the hidden states for the next stage.
        Under context parallelism ``s`` is this rank's two load-balanced chunks of the sequence and
        missing ``position_ids`` default to their global positions (not ``0..s-1``).

        Multi-token prediction runs when the model has it and ``labels``, ``mtp_tokens`` and
        ``mtp_labels`` (``[D, b, s]``, from :func:`~megatron_lite.models.mtp.mtp_targets`) are given:
        the per-token losses are then stacked ``[1 + D, b, s]`` (row 0 the main loss, row k depth k).

        ``inference_context`` (a :class:`~megatron_lite.inference.KVCache`): ``tokens`` are the next
        tokens after the ``inference_context.sequence_offset`` cached ones; missing ``position_ids``
        continue from there. The caller advances the cache after the forward pass. Generation runs
        the main head only (multi-token prediction needs labels); ``return_hidden`` (last stage, no
        labels) returns ``(logits, hidden)``, ``hidden [s, b, h]`` the decoder's normed output that
        :meth:`mtp_decode`'s first depth reads.
        """
        if inference_context is not None and position_ids is None:
            position_ids = self._cached_positions(tokens, inference_context)
        hidden = self._input_hidden(tokens, position_ids)
        rotary = self._rotary(hidden, position_ids)
        hidden = self.decoder(hidden, attention_mask, rotary, inference_context=inference_context)
        if not self.post_process:
            return hidden
        loss = self._lm_output(self._logits(hidden), labels)
        if return_hidden:
            return loss, hidden
        if self.mtp is None or labels is None or mtp_labels is None:
            return loss
        outputs = self.mtp(hidden, mtp_tokens, self._embed_for_mtp, attention_mask, rotary, self.decoder.causal)
        # the MTP heads were built after the main head, so backward reaches their output GEMMs first
        mtp_losses = [self._lm_output(self._logits(h, last_use=False), mtp_labels[k]) for k, h in enumerate(outputs)]
        return torch.stack([loss] + mtp_losses)

    def _embed_for_mtp(self, tokens):
        """The (shared) word embedding of ``tokens [b, s]``, ``[s(/tp), b, h]``."""
        return self.embedding(tokens)

    def mtp_decode(self, depth: int, hidden, tokens, inference_context, position_ids=None, attention_mask=None):
        """Speculative decoding's draft step: multi-token prediction depth ``depth`` (1-based) over new
        positions ``[p, p + s)`` after the ``p = inference_context.sequence_offset`` ones cached in that
        depth's own cache. ``hidden [s, b, h]``: the previous depth's outputs at those positions (depth
        1: the decoder's, from ``forward(..., return_hidden=True)``); ``tokens [b, s]``: the tokens
        ``depth`` places ahead of each position (``t(i + depth)`` at position ``i``). Returns ``(logits
        [b, 1, padded_vocab/tp] of the last position, which predict the token depth + 1 after it, this
        depth's outputs [s, b, h])``. The caller advances the cache. ``position_ids``, ``attention_mask``:
        a batch whose rows stand at different lengths (a paged cache's, as :meth:`forward` takes them)."""
        if position_ids is None:
            position_ids = self._cached_positions(tokens, inference_context)
        embedded = self.embedding(tokens, None if self.use_rope else position_ids)
        rotary = self._rotary(hidden, position_ids)
        out = self.mtp.layers[depth - 1](hidden, embedded, attention_mask, rotary, self.decoder.causal,
                                         inference_context=inference_context)
        return self._lm_output(self._logits(out[-1:]), None), out
