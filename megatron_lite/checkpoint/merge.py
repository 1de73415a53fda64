"""Load a training checkpoint of any TP x PP (x EP) layout into one single-process GPTModel or BertModel.

A checkpoint holds one ``mp_rank_{tp:02d}_{pp:03d}[_{ep:03d}]/model_optim_rng.pt`` per tensor-,
pipeline- (and expert-) parallel rank (see :mod:`megatron_lite.checkpoint.format`). Each file lists,
per model chunk, the state dict, ``param_meta`` (partition dim and stride of every tensor-parallel
parameter) and the chunk's global ``layer_ranges``. Merging is three steps:

1. per pipeline rank, expert rank and chunk, glue the TP shards of each tensor-parallel parameter
   back together with :func:`~megatron_lite.parallel.tensor.unshard` (replicated tensors are taken
   from TP rank 0);
2. with expert parallelism, give the experts of EP rank e their global numbers: local expert j is
   expert ``e * E_local + j`` (``mlp.experts.local_experts.{j}``), and the stacked grouped-GEMM
   weights (``mlp.experts.weight1`` ...) are concatenated over the EP ranks; everything else (dense
   layers, router, shared experts) is taken from EP rank 0;
3. renumber each chunk's local ``decoder.layers.{i}`` (BERT: ``encoder.layers.{i}``) to the global
   layer ``start + i`` and take the
   embedding from the first chunk and the final norm / output layer from the last. A tied model's
   last-stage copy of the embedding (``output_layer.weight``), and the copy a multi-token-prediction
   stage holds (``embedding.word_embeddings.weight``), are dropped: the first chunk's is the weight.

``keep`` (a predicate on the single-process names) merges only part of the checkpoint: a pipeline
stage's files are read only when it holds a kept tensor (each stage's names and layer ranges come
from one file's index, memory-mapped, without reading its tensors), one stage at a time; ``--pretrained-checkpoint``
and upcycling merge so only the tensors of a rank (:func:`~megatron_lite.checkpoint.pretrained.merge_for_rank`).

The model is rebuilt from the ``config`` dict saved in the checkpoint, with the saved padded
vocabulary size (padding depends on the TP size the checkpoint was trained with).
"""

from __future__ import annotations

import dataclasses
import functools
import re

import torch

from ..config import ModelConfig
from ..fusions.config import fusion_fields
from ..models import BertModel, GPTModel, TransformerConfig
from ..moe.config import saved_moe_fields
from ..parallel.state import ParallelState
from ..parallel.tensor import unshard
from ..precision.fp8 import is_fp8_state_key
from .dist_read import is_dist_folder, merge_dist, resolve_folder
from .expert_files import merge_folded_chunk
from .format import MODEL_KEYS, CheckpointError, find_model_files, read_model_file
from .router_bias import fill_merged

_LAYER = re.compile(r"^(decoder|encoder)\.layers\.(\d+)\.(.*)$")
_LOCAL_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")


def model_config_from_saved(saved: dict) -> ModelConfig:
    """The ModelConfig fields of a checkpoint's flat ``config`` dict."""
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    cfg = ModelConfig(**{k: v for k, v in saved.items() if k in names})
    if cfg.padded_vocab_size is None:
        raise CheckpointError("the checkpoint's config has no padded_vocab_size; it was not written by megatron_lite")
    return cfg


def _strip(sd: dict) -> dict:
    return {(k[len("module."):] if k.startswith("module.") else k): v for k, v in sd.items()}


def _merge_tp(shards: list[dict], c: int, keep=None) -> dict:
    """Chunk ``c`` of one (pipeline, expert) rank with its TP shards glued together (``keep``: a
    predicate on the chunk's names; the others are left out)."""
    sds = [_strip(s["model"][c]) for s in shards]
    meta = _strip(shards[0]["param_meta"][c])
    chunk = {}
    for name, tensor in sds[0].items():
        if keep is not None and not keep(name):
            continue
        if name in meta:
            parts = [sd[name] for sd in sds]
            chunk[name] = unshard(parts, meta[name]["partition_dim"], meta[name]["partition_stride"])
        else:
            chunk[name] = tensor
    return chunk


def _merge_ep(chunks: list[dict], per_rank: int | None = None) -> dict:
    """One chunk from its EP ranks' chunks: experts renumbered / concatenated, the rest from rank 0
    (``per_rank``: the experts of each EP rank, when the chunks hold only some of them)."""
    if len(chunks) == 1:
        return chunks[0]
    merged = {}
    for name, tensor in chunks[0].items():
        m = _LOCAL_EXPERT.match(name)
        if m:
            local = per_rank or len({int(_LOCAL_EXPERT.match(n).group(2)) for n in chunks[0] if n.startswith(m.group(1))})
            for e, chunk in enumerate(chunks):
                merged[f"{m.group(1)}{e * local + int(m.group(2))}{m.group(3)}"] = chunk[name]
        elif ".mlp.experts." in name:  # grouped GEMM: [local experts, ...] stacked
            merged[name] = torch.cat([chunk[name] for chunk in chunks])
        else:
            merged[name] = tensor
    return merged


def _peek(file: str) -> dict:
    """The payload of one model file with its tensors memory-mapped, not read: its sizes, config and
    each chunk's names and layer range cost only the file's index. A file that cannot be mapped (an
    old-style file, a damaged one) is read whole, which gives the one-line error of a bad file."""
    try:
        payload = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        return read_model_file(file)
    if not isinstance(payload, dict) or any(k not in payload for k in MODEL_KEYS) or not isinstance(payload["model"], list):
        return read_model_file(file)
    return payload


def _stage_files(path: str) -> tuple[dict, dict, int, int, int]:
    """({pp rank: {(tp, pp, ep[, etp]): file}}, the first file's payload (peeked), tp, pp, ep sizes) of a
    checkpoint, checked complete."""
    files = find_model_files(path)
    folded = len(next(iter(files))) == 4  # a folded expert grid's files (expert_files.py)
    if not folded:
        files = {(key + (0,))[:3]: file for key, file in files.items()}
    first = _peek(files[min(files)])
    tp, pp, ep = first["tp_size"], first["pp_size"], first.get("ep_size", 1)
    want = {(t, p, e) for t in range(tp) for p in range(pp) for e in range(ep)}
    if not folded and set(files) != want:
        missing = sorted(key[: 3 if ep > 1 else 2] for key in want - set(files))
        layout = f"--tensor-model-parallel-size {tp} --pipeline-model-parallel-size {pp}"
        layout, ranks = (f"{layout} --expert-model-parallel-size {ep}", "(tp, pp, ep)") if ep > 1 else (layout, "(tp, pp)")
        raise CheckpointError(f"{path}: saved with {layout} but mp_rank files for {ranks} {missing} are missing; "
                              "the checkpoint is incomplete")
    stages: dict = {}
    for key, file in sorted(files.items()):
        stages.setdefault(key[1], {})[key] = file
    return stages, first, tp, pp, ep


def _final_name(name: str, start: int, tied: bool) -> str | None:
    """The single-process name of chunk tensor ``name`` (EP-merged) of the chunk starting at layer
    ``start``, or None for a copy of the embedding that the first chunk's stands for."""
    m = _LAYER.match(name)
    if m:
        return f"{m.group(1)}.layers.{start + int(m.group(2))}.{m.group(3)}"
    if name == "output_layer.weight" and tied:
        return None  # the last stage's copy of the tied embedding
    if name.startswith("embedding.") and start > 0:
        return None  # a multi-token-prediction stage's copy of the embedding
    return name


def _chunk_keep(keep, start: int, tied: bool, ep: int, per_rank: int):
    """``keep`` on a chunk's local names (before the EP merge): a local expert is kept when it is kept
    as the expert of any EP rank, so every EP rank's chunk keeps the same names."""
    def local(name: str) -> bool:
        final = _final_name(name, start, tied)
        if final is None:
            return False
        m = _LOCAL_EXPERT.match(final)
        if m is None or ep == 1:
            return keep(final)
        j = int(m.group(2))
        return any(keep(f"{m.group(1)}{e * per_rank + j}{m.group(3)}") for e in range(ep))
    return local


def merge_checkpoint(path: str, filled: list | None = None, keep=None) -> tuple[dict, dict]:
    """(single-process state dict, saved flat config) from a save folder, ``iter_*`` folder.
    An MoE router bias the checkpoint lacks is zero (:mod:`.router_bias`); ``filled`` gets their names.

    The config dict also holds the checkpoint's ``iteration`` and ``consumed_samples``. A torch_dist
    checkpoint (:mod:`~megatron_lite.checkpoint.dist_read`) is merged from its saved boxes.

    ``keep`` (a predicate on single-process names; None: every tensor) merges only the tensors it
    accepts: the model files of a pipeline stage are read only when one of its tensors is kept (the
    others' names and layer ranges are read from their index, not their data), and a torch_dist
    checkpoint reads only the kept tensors' boxes."""
    if is_dist_folder(resolve_folder(path)):
        return merge_dist(path, filled, keep)
    stages, first, tp, pp, ep = _stage_files(path)
    saved_config = dict(first["config"])
    for key in ("iteration", "consumed_samples"):
        saved_config.setdefault(key, first.get(key))
    tied = not saved_config.get("untie_embeddings_and_output_weights", False)
    per_rank = int(saved_config.get("num_experts") or 0) // ep
    folded = first.get("expert_grid_folded", False)

    chunks = []  # (layer_start, merged chunk state dict), in global layer order
    for p in range(pp):
        index = first if p == 0 else _peek(stages[p][min(stages[p])])
        picked = []
        for c, (start, _end) in enumerate(index["layer_ranges"]):
            local = None if keep is None else _chunk_keep(keep, start, tied, ep, per_rank)
            if local is None or any(local(name) for name in _strip(index["model"][c])):
                picked.append((c, start, local))
        if not picked:
            continue  # no tensor of this stage is wanted: its files are not read
        payloads = {key: read_model_file(file) for key, file in stages[p].items()}
        for c, start, local in picked:
            merge_tp = functools.partial(_merge_tp, keep=local)
            merge_ep = functools.partial(_merge_ep, per_rank=None if keep is None else per_rank)
            if folded:
                chunks.append((start, merge_folded_chunk(path, payloads, p, c, merge_tp, merge_ep)))
                continue
            per_ep = [merge_tp([payloads[(t, p, e)] for t in range(tp)], c) for e in range(ep)]
            chunks.append((start, merge_ep(per_ep)))
        del payloads
    chunks.sort(key=lambda item: item[0])
    merged: dict = {}
    for start, chunk in chunks:
        for name, tensor in chunk.items():
            name = _final_name(name, start, tied)
            if name is not None and (keep is None or keep(name)):
                merged[name] = tensor
    (filled if filled is not None else []).extend(fill_merged(merged, saved_config, path))
    return merged, saved_config


def refuse_lora(path: str, saved: dict) -> None:
    """A LoRA training checkpoint (``--lora-rank``) holds only adapters: one CheckpointError saying to merge it."""
    if saved.get("lora_rank"):
        kind = "BERT" if "bert_no_binary_head" in saved else "GPT"
        raise CheckpointError(f"{path} is a LoRA checkpoint: it holds only the adapters of its base; merge them first "
                              f"(tools/checkpoint/convert.py --model-type {kind} --load-dir {path} --save-dir MERGED) "
                              "and load the merged checkpoint")


def _load_into(path: str, build, kind: str, params_dtype=torch.float32) -> tuple[torch.nn.Module, dict]:
    """Merge the checkpoint and load it into ``build(transformer_config, state, saved_config)``."""
    state_dict, saved = merge_checkpoint(path)
    refuse_lora(path, saved)
    # FP8 bookkeeping (amax histories, scales) of an FP8-trained run: the model built here has none
    state_dict = {k: v for k, v in state_dict.items() if not is_fp8_state_key(k)}
    cfg = model_config_from_saved(saved)
    moe = saved_moe_fields(saved)  # built without FP8
    moe["expert_tensor_parallel_size"] = None  # one process: whole experts
    try:
        model = build(TransformerConfig.from_model(cfg, params_dtype=params_dtype, **moe,
                                                   **fusion_fields(saved, cfg.swiglu)),
                      ParallelState(world_size=1, rank=0), saved)
    except CheckpointError:
        raise
    except ValueError as err:
        raise CheckpointError(f"{path}: the saved model config is not usable ({err})") from None
    ours = model.state_dict()
    missing = sorted(set(ours) - set(state_dict))
    extra = sorted(set(state_dict) - set(ours))
    wrong = [f"{k} {tuple(state_dict[k].shape)} vs {tuple(v.shape)}" for k, v in ours.items()
             if k in state_dict and state_dict[k].shape != v.shape]
    if missing or extra or wrong:
        detail = "; ".join(x for x in (
            f"missing {', '.join(missing[:3])}" if missing else "",
            f"unexpected {', '.join(extra[:3])}" if extra else "",
            f"shape {', '.join(wrong[:3])}" if wrong else "",
        ) if x)
        raise CheckpointError(f"{path}: the weights do not fit a {kind} built from the saved config ({detail})")
    model.load_state_dict(state_dict)
    return model.eval(), saved


def load_gpt_checkpoint(path: str, params_dtype=torch.float32) -> tuple[GPTModel, dict]:
    """A single-process ``GPTModel`` (eval mode) holding the checkpoint's weights, and its saved config."""
    return _load_into(path, lambda config, state, saved: GPTModel(config, state), "GPT", params_dtype)


def load_bert_checkpoint(path: str) -> tuple[BertModel, dict]:
    """A single-process ``BertModel`` (eval mode, fp32) holding the checkpoint's weights, and its saved
    config (``bert_no_binary_head`` decides the binary head and token types, as in pretrain_bert.py)."""

    def build(config, state, saved):
        if "bert_no_binary_head" not in saved:
            raise CheckpointError(f"{path} was not saved by pretrain_bert.py (its config has no BERT flags)")
        head = not saved["bert_no_binary_head"]
        return BertModel(config, state, num_tokentypes=2 if head else 0, add_binary_head=head)

    return _load_into(path, build, "BERT")
