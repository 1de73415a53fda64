"""Offline resharding: read a checkpoint of any layout into one layout-free :class:`ModelBundle`, and
write a bundle as a training checkpoint of any tensor x pipeline (x virtual pipeline) layout.

A :class:`ModelBundle` is what travels between a checkpoint loader and a saver (the Megatron and the
Hugging Face plugins of ``tools/checkpoint/convert.py``): the weights of a single-process
:class:`~megatron_lite.models.GPTModel` and the flat config that describes it. Its vocabulary rows
are *unpadded* (exactly ``vocab_size`` rows), because the padding depends on the tensor-parallel
size: a saver pads again for its target size, with zero rows (padded rows never reach the loss,
which only counts the real vocabulary).

Writing a layout does not re-derive any sharding rule: for each target pipeline chunk the saver
builds the chunk's model on the ``meta`` device (no memory, no init cost), takes its state-dict
names and full shapes, and its ``param_meta`` (partition dim and stride of each tensor-parallel
parameter, e.g. stride 2 for SwiGLU's ``[gate; up]`` fc1), then cuts every full tensor with
:func:`~megatron_lite.parallel.tensor.shard`, the function the layers themselves use to take their
slice of the initial weights. The fused QKV weight is ``[groups, (heads_per_group + 2) * head_dim,
hidden]`` with whole key/value groups per rank, so a contiguous split is exact for any TP dividing
the number of groups. A tied model's last pipeline stage gets its copy of the word embedding as
``output_layer.weight``, as in training.

The optimizer state (Adam moments, fp32 masters, loss scaler) is resharded the same way
(:mod:`~megatron_lite.checkpoint.reshard_optim`) and the learning-rate schedule copied, with the
source's iteration and consumed samples: resume with ``--no-load-rng`` (RNG states are per rank and
do not carry over to another layout). A source without optimizer state gives model files with
``optimizer`` None: resume with ``--no-load-optim --no-load-rng``, or ``--finetune``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

import torch

from ..errors import ConfigError
from ..models import GPTModel, TransformerConfig
from ..parallel.pipeline.partition import layer_ranges
from ..parallel.state import ParallelState
from ..parallel.tensor import padded_vocab_size, shard
from .dist_read import is_dist_folder, merge_dist_optimizer, resolve_folder
from .format import (
    FORMAT_VERSION,
    TRACKER_FILENAME,
    CheckpointError,
    atomic_save,
    atomic_write_text,
    find_model_files,
    iteration_dir,
    model_file,
    param_meta,
    read_tracker,
    with_checksums,
)
from .hf_io import TOKENIZER_DIR, tokenizer_files_in
from .merge import merge_checkpoint, model_config_from_saved
from .reshard_optim import merge_optimizer, split_optimizer

# Tensors whose rows are the (padded) vocabulary.
VOCAB_TENSORS = ("embedding.word_embeddings.weight", "output_layer.weight")


def _no_progress(iterable, **_kw):
    return iterable


@dataclass
class ModelBundle:
    """A layout-free model: single-process weights (vocabulary unpadded) and the flat config.

    ``config`` holds at least the :class:`~megatron_lite.config.ModelConfig` fields by name
    (``vocab_size`` is the real vocabulary). ``tokenizer_files`` maps file names a saver may write
    (``tokenizer.json``, ``vocab.json``, ...) to existing paths to copy from.
    """

    config: dict
    state_dict: dict
    iteration: int | str = "release"
    consumed_samples: int = 0
    tokenizer_files: dict = field(default_factory=dict)
    optimizer: dict | None = None  # layout-free optimizer state (see reshard_optim.merge_optimizer), or None

    @property
    def tied(self) -> bool:
        return not self.config.get("untie_embeddings_and_output_weights", False)


def unpad_vocab(state_dict: dict, vocab_size: int) -> dict:
    """The state dict with the vocabulary tensors cut to their first ``vocab_size`` rows."""
    return {k: (v[:vocab_size].clone() if k in VOCAB_TENSORS else v) for k, v in state_dict.items()}


def pad_vocab(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """``tensor`` with zero rows appended up to ``rows`` (a padded vocabulary)."""
    if tensor.shape[0] > rows:
        raise CheckpointError(f"vocabulary tensor has {tensor.shape[0]} rows, more than the padded size {rows}")
    pad = tensor.new_zeros((rows - tensor.shape[0], *tensor.shape[1:]))
    return torch.cat([tensor, pad]) if rows > tensor.shape[0] else tensor


# ---------------------------------------------------------------------------------------------
# Loader: a megatron_lite checkpoint of any TP x PP (x VPP) layout.


def load_megatron(load_dir: str, progress=_no_progress) -> ModelBundle:
    """The bundle of a megatron_lite checkpoint (save folder's latest iteration, or an ``iter_*`` folder).

    Tokenizer files to carry along: those in ``<load_dir>/tokenizer/`` and the files the saved
    config's ``--vocab-file`` / ``--merge-file`` / ``--tokenizer-model`` name, when they exist."""
    state_dict, config = merge_checkpoint(load_dir)
    iteration = config.pop("iteration", None)
    consumed = config.pop("consumed_samples", 0) or 0
    if iteration is None:
        iteration = read_tracker(load_dir) or "release"
    vocab = config.get("vocab_size") or config["padded_vocab_size"]
    config["vocab_size"], config["padded_vocab_size"] = vocab, None
    files = tokenizer_files_in(os.path.join(load_dir, TOKENIZER_DIR))  # kept by an earlier conversion
    for key, name in (("vocab_file", "vocab.json"), ("merge_file", "merges.txt")):
        if config.get(key) and os.path.isfile(config[key]):
            files[name] = config[key]
    model = config.get("tokenizer_model")
    if model and os.path.isfile(model):
        files["tokenizer.json" if model.endswith(".json") else "tokenizer.model"] = model
    optimizer = merge_dist_optimizer(load_dir) if is_dist_folder(resolve_folder(load_dir)) else merge_optimizer(
        load_dir, lambda p, payload: _source_chunks(payload, p), not config.get("untie_embeddings_and_output_weights", False))
    if optimizer is not None:
        optimizer["state"] = {k: unpad_vocab(table, vocab) for k, table in optimizer["state"].items()}
        if optimizer["masters"] is not None:
            optimizer["masters"] = unpad_vocab(optimizer["masters"], vocab)
    return ModelBundle(config, unpad_vocab(state_dict, vocab), iteration, int(consumed), files, optimizer)


def _source_chunks(payload: dict, pp_rank: int) -> list:
    """(meta model, layer_start) of each chunk of one source model file."""
    ranges = [tuple(r) for r in payload["layer_ranges"]]
    last = payload["pp_size"] - 1
    return [(_chunk_model(payload["config"], pp_rank == 0 and c == 0, pp_rank == last and c == len(ranges) - 1, s, e), s)
            for c, (s, e) in enumerate(ranges)]


# ---------------------------------------------------------------------------------------------
# Saver: a megatron_lite checkpoint at a target layout.


@dataclass(frozen=True)
class TargetLayout:
    """The parallel layout to write (the ``--target-*`` options of the converter)."""

    tp: int = 1
    pp: int = 1
    vpp_layers: int | None = None  # --num-layers-per-virtual-pipeline-stage
    first: int | None = None  # --decoder-first-pipeline-num-layers
    last: int | None = None  # --decoder-last-pipeline-num-layers


def target_config(bundle: ModelBundle, layout: TargetLayout) -> dict:
    """The flat config the target checkpoint records: the bundle's, with the new layout and padding."""
    cfg = dict(bundle.config)
    model = model_config_from_saved({**cfg, "padded_vocab_size": 0})
    padded = padded_vocab_size(model.vocab_size, model.make_vocab_size_divisible_by, layout.tp)
    try:  # the model's own shape rules, at the target TP size
        TransformerConfig.from_model(dataclasses.replace(model, padded_vocab_size=padded),
                                     tensor_model_parallel_size=layout.tp)
        ranges = layer_ranges(model.num_layers, layout.pp, layout.vpp_layers, layout.first, layout.last)
    except (ConfigError, ValueError) as err:
        raise ConfigError(f"target layout tp {layout.tp} x pp {layout.pp}: {err}") from None
    cfg.update(
        padded_vocab_size=padded, tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        num_layers_per_virtual_pipeline_stage=layout.vpp_layers, decoder_first_pipeline_num_layers=layout.first,
        decoder_last_pipeline_num_layers=layout.last, sequence_parallel=bool(cfg.get("sequence_parallel")) and layout.tp > 1,
    )
    cfg["_ranges"] = ranges
    return cfg


def _chunk_model(cfg: dict, pre: bool, post: bool, start: int, end: int) -> GPTModel:
    """One pipeline chunk at TP 1 on the meta device: its names, full shapes and param_meta, no memory."""
    model = model_config_from_saved(cfg)
    with torch.device("meta"):
        return GPTModel(TransformerConfig.from_model(model, tensor_model_parallel_size=1), ParallelState(world_size=1, rank=0),
                        pre_process=pre, post_process=post, layer_start=start, layer_end=end)


def _full_tensor(bundle: ModelBundle, name: str, start: int, padded: int, table: dict | None = None) -> torch.Tensor:
    """The full tensor for chunk-local ``name`` (layer numbers are chunk-local) from ``table``
    (default: the bundle's weights; an optimizer state table has the same names)."""
    table = bundle.state_dict if table is None else table
    key = name
    if name.startswith("decoder.layers."):
        local, rest = name[len("decoder.layers."):].split(".", 1)
        key = f"decoder.layers.{start + int(local)}.{rest}"
    elif name == "output_layer.weight" and bundle.tied:
        key = "embedding.word_embeddings.weight"  # the last stage's copy of the tied embedding
    if key not in table:
        raise CheckpointError(f"the source has no tensor {key}; it does not fit the model its config describes")
    tensor = table[key]
    return pad_vocab(tensor, padded) if name in VOCAB_TENSORS else tensor


def _chunk_shards(bundle, cfg, chunk, start, tp) -> tuple[list[dict], dict]:
    """(per-TP-rank state dicts, param_meta) of one chunk (a meta model)."""
    meta = param_meta(chunk)
    shards = [{} for _ in range(tp)]
    for name, expected in chunk.state_dict().items():
        full = _full_tensor(bundle, name, start, cfg["padded_vocab_size"])
        if tuple(full.shape) != tuple(expected.shape):
            raise CheckpointError(f"source tensor for {name} has shape {tuple(full.shape)}, the model needs "
                                  f"{tuple(expected.shape)}; the weights do not fit the config")
        for t in range(tp):
            part = shard(full, meta[name]["partition_dim"], t, tp, meta[name]["partition_stride"]) if name in meta else full
            shards[t][name] = part.clone()
    return shards, meta


def _check_all_used(bundle: ModelBundle, cfg: dict) -> None:
    """Every tensor of the bundle must have a place in the model (e.g. no expert weights left behind)."""
    with torch.device("meta"):
        names = set(GPTModel(TransformerConfig.from_model(model_config_from_saved(cfg), tensor_model_parallel_size=1),
                             ParallelState(world_size=1, rank=0)).state_dict())
    extra = sorted(set(bundle.state_dict) - names)
    if extra:
        raise CheckpointError(f"the source has tensors the model has no place for: {', '.join(extra[:3])}"
                              + (" ..." if len(extra) > 3 else ""))


def save_megatron(bundle: ModelBundle, save_dir: str, layout: TargetLayout, progress=_no_progress) -> str:
    """Write ``bundle`` as a checkpoint of ``layout`` under ``save_dir`` (tracker last); returns the iteration folder."""
    cfg = target_config(bundle, layout)
    ranges = cfg.pop("_ranges")
    padded = cfg["padded_vocab_size"]
    _check_all_used(bundle, cfg)
    iteration = bundle.iteration
    if os.path.isdir(iteration_dir(save_dir, iteration)) and os.listdir(iteration_dir(save_dir, iteration)):
        raise CheckpointError(f"{iteration_dir(save_dir, iteration)} already exists; choose an empty --save-dir")
    chunks_per_rank = len(ranges[0])
    for p in progress(range(layout.pp), desc="pipeline stages", unit="stage"):
        models = [(_chunk_model(cfg, p == 0 and c == 0, p == layout.pp - 1 and c == chunks_per_rank - 1, s, e), s)
                  for c, (s, e) in enumerate(ranges[p])]
        per_chunk = [_chunk_shards(bundle, cfg, model, s, layout.tp) for model, s in models]
        for t in range(layout.tp):
            payload = {
                "iteration": 0 if iteration == "release" else int(iteration),
                "consumed_samples": int(bundle.consumed_samples),
                "config": cfg,
                "tp_size": layout.tp, "pp_size": layout.pp, "ep_size": 1, "dp_size": 1,
                "vpp_size": chunks_per_rank if chunks_per_rank > 1 else None,
                "num_chunks": chunks_per_rank,
                "world_size": layout.tp * layout.pp,
                "model": [shards[t] for shards, _ in per_chunk],
                "param_meta": [meta for _, meta in per_chunk],
                "layer_ranges": [tuple(r) for r in ranges[p]],
                "optimizer": None if bundle.optimizer is None else split_optimizer(
                    bundle.optimizer, models, t, layout.tp, lambda name, table: _full_tensor(bundle, name, 0, padded, table)),
                "scheduler": None if bundle.optimizer is None else bundle.optimizer["scheduler"],
                "format_version": FORMAT_VERSION,
            }
            atomic_save(with_checksums(payload), model_file(save_dir, iteration, t, p))
    atomic_write_text(os.path.join(save_dir, TRACKER_FILENAME), f"{iteration}\n")
    find_model_files(save_dir)  # reads back the folder listing: every rank's file is in place
    return iteration_dir(save_dir, iteration)
