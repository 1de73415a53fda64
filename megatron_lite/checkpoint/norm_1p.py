"""``--apply-layernorm-1p`` across formats: our zero-centred norm weights ``w`` (the norm scales by
``1 + w``) against the plain ones every Hugging Face family stores (the norm scales by its weight).

Which tensors are norm weights is read off the model itself (the :class:`~megatron_lite.models.common.Norm`
modules of the whole model built on the ``meta`` device), so every norm is covered: the layers'
input and pre-MLP norms, the final norm, MLA's latent norms, MTP's norms, BERT's head norm.
"""

from __future__ import annotations

from ..models.common import Norm


def norm_weight_names(cfg: dict) -> set[str]:
    """The state-dict names of every norm weight of the single-process model of flat config ``cfg``."""
    from .layout import chunk_model  # (layout imports the converter's readers)

    model = chunk_model({**cfg, "padded_vocab_size": cfg.get("padded_vocab_size") or cfg["vocab_size"]})  # (unpadded)
    return {f"{name}.weight" for name, module in model.named_modules() if isinstance(module, Norm)}


def plain_norms(cfg: dict, sd: dict) -> tuple[dict, dict]:
    """(config, state dict) of the same model with plain norm weights (``1 + w``) when ``cfg`` has
    ``--apply-layernorm-1p``; unchanged otherwise."""
    if not cfg.get("apply_layernorm_1p"):
        return cfg, sd
    names = norm_weight_names(cfg)
    return {**cfg, "apply_layernorm_1p": False}, {k: v + 1 if k in names else v for k, v in sd.items()}


def zero_centred_norms(cfg: dict, sd: dict) -> tuple[dict, dict]:
    """The inverse of :func:`plain_norms`: (config with ``--apply-layernorm-1p``, weights ``w - 1``)."""
    if cfg.get("apply_layernorm_1p"):
        return cfg, sd
    out = {**cfg, "apply_layernorm_1p": True}
    names = norm_weight_names(out)
    return out, {k: v - 1 if k in names else v for k, v in sd.items()}
