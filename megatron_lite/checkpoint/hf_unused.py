"""Every tensor of a Hugging Face folder must be used by the import, or be a known harmless extra.

A tensor the import does not read means the folder holds more than its ``config.json`` describes: a
``num_hidden_layers`` smaller than the layers in the weights converted silently into a truncated
model, biases with ``attention_bias`` false were dropped. :class:`TensorReads` records the names the
readers take (through prefix-stripped views, too); :func:`refuse_unused` then refuses the rest in one
line, except what ``transformers`` (this and older versions) saves beside the weights: the rotary
``inv_freq`` and BERT ``position_ids`` buffers, GPT-2's causal-mask buffers ``attn.bias`` /
``attn.masked_bias``, and copies of tied weights (``lm_head.weight`` or ``cls.predictions.decoder.weight``
equal to the word embedding, ``cls.predictions.decoder.bias`` equal to ``cls.predictions.bias``).
"""

from __future__ import annotations

import re

import torch

from .format import CheckpointError

BUFFERS = re.compile(r"(^|\.)(rotary_emb\.inv_freq|position_ids)$")
GPT2_BUFFERS = re.compile(r"(^|\.)h\.\d+\.attn\.(bias|masked_bias)$")
EMBEDDINGS = ("model.embed_tokens.weight", "embed_tokens.weight", "transformer.wte.weight", "wte.weight",
              "bert.embeddings.word_embeddings.weight")
# a copy of a tied tensor: (its name, the names it may copy)
TIED_COPIES = {"lm_head.weight": EMBEDDINGS, "cls.predictions.decoder.weight": EMBEDDINGS,
               "cls.predictions.decoder.bias": ("cls.predictions.bias",)}
LAYER = re.compile(r"(?:^|\.)(?:layers|h|layer)\.(\d+)\.")
EXPERT = re.compile(r"\.experts\.(\d+)\.")


class TensorReads(dict):
    """``{name: tensor}`` remembering which names were read (``[]`` or ``get``), in the order read; views
    made by :meth:`strip` record into the same dict, under the names in the file."""

    def __init__(self, tensors: dict, names: dict | None = None, read: dict | None = None):
        super().__init__(tensors)
        self.names = names if names is not None else {k: k for k in tensors}
        self.read = read if read is not None else {}  # an ordered set: the last name read is last

    def __getitem__(self, key):
        value = super().__getitem__(key)
        self.read.pop(self.names[key], None)
        self.read[self.names[key]] = None
        return value

    def last_read(self) -> str | None:
        return next(reversed(self.read), None)

    def get(self, key, default=None):
        return self[key] if key in self else default

    def strip(self, prefix: str) -> TensorReads:
        items = [(k[len(prefix):] if k.startswith(prefix) else k, k) for k in dict.keys(self)]
        return TensorReads({s: dict.__getitem__(self, k) for s, k in items}, {s: self.names[k] for s, k in items},
                           self.read)


def strip_prefix(tensors: dict, prefix: str) -> dict:
    """``tensors`` with ``prefix`` removed from the names carrying it (reads still recorded)."""
    if isinstance(tensors, TensorReads):
        return tensors.strip(prefix)
    return {(k[len(prefix):] if k.startswith(prefix) else k): v for k, v in tensors.items()}


def _harmless(name: str, tensors: TensorReads, gpt2: bool) -> bool:
    if BUFFERS.search(name) or (gpt2 and GPT2_BUFFERS.search(name)):
        return True
    value = dict.get(tensors, name)
    return any(other != name and other in tensors and value.shape == dict.__getitem__(tensors, other).shape
               and torch.equal(value, dict.__getitem__(tensors, other)) for other in TIED_COPIES.get(name, ()))


def _cause(unused: list[str], hf: dict) -> str:
    layers = hf.get("num_hidden_layers", hf.get("n_layer"))
    mtp = int(hf.get("num_nextn_predict_layers") or 0) if hf.get("model_type") == "deepseek_v3" else 0
    held = max((int(m.group(1)) + 1 for n in unused for m in [LAYER.search(n)] if m), default=0)
    if isinstance(layers, int) and held > layers + mtp:
        field = ("n_layer" if "n_layer" in hf else "num_hidden_layers") + (" + num_nextn_predict_layers" if mtp else "")
        return (f"config.json's {field} says {layers + mtp} layers but the weights hold {held}; fix config.json "
                "(a truncated model would be written)")
    experts = hf.get("num_local_experts", hf.get("n_routed_experts"))
    held = max((int(m.group(1)) + 1 for n in unused for m in [EXPERT.search(n)] if m), default=0)
    if isinstance(experts, int) and held > experts:
        field = "num_local_experts" if "num_local_experts" in hf else "n_routed_experts"
        return f"config.json's {field} says {experts} experts but the weights hold {held}; fix config.json"
    if any(n in TIED_COPIES for n in unused):
        return ("tie_word_embeddings is true but the output layer differs from the word embedding; set it false in "
                "config.json")
    return ("the weights hold tensors config.json does not describe (another model type, or an option it leaves "
            "out, such as attention_bias); fix config.json or download the model again")


def refuse_unused(tensors: TensorReads, hf: dict, folder: str) -> None:
    """One CheckpointError naming a few tensors of ``folder`` the import did not read, and why."""
    gpt2 = hf.get("model_type") == "gpt2"
    unused = sorted(n for n in set(tensors.names.values()) - set(tensors.read) if not _harmless(n, tensors, gpt2))
    if unused:
        shown = ", ".join(unused[:3]) + (f" (and {len(unused) - 3} more)" if len(unused) > 3 else "")
        raise CheckpointError(f"{folder}: {len(unused)} tensor(s) would be dropped by the import: {shown}; "
                              f"{_cause(unused, hf)}")


def refuse_vocab_mismatch(tensors: dict, hf: dict, path: str) -> None:
    """One CheckpointError when config.json's ``vocab_size`` is not the row count of the word embedding
    or ``lm_head``: transformers refuses such a folder too (its embeddings have exactly ``vocab_size``
    rows; a padded vocabulary is padded in both), and the import would build another vocabulary."""
    vocab = hf.get("vocab_size")
    for name in (*EMBEDDINGS, "lm_head.weight", "cls.predictions.decoder.weight"):
        rows = dict.__getitem__(tensors, name).shape[0] if name in tensors else None
        if vocab is not None and rows is not None and rows != vocab:
            raise CheckpointError(f"{path}: vocab_size is {vocab} but {name} has {rows} rows (transformers refuses "
                                  f"this folder too); set vocab_size to {rows} there or download the model again")
