"""Offline resharding: read a checkpoint of any layout into one layout-free :class:`ModelBundle`, and
write a bundle as a training checkpoint of any tensor x pipeline (x virtual pipeline) x expert layout.

A :class:`ModelBundle` is what travels between a checkpoint loader and a saver (the Megatron and the
Hugging Face plugins of ``tools/checkpoint/convert.py``): the weights of a single-process
:class:`~megatron_lite.models.GPTModel` or :class:`~megatron_lite.models.BertModel` (every expert
under its global number) and the flat config that describes it. Its vocabulary rows are *unpadded*
(exactly ``vocab_size`` rows; BERT's output bias too), because the padding depends on the
tensor-parallel size: a saver pads again for its target size, with zero rows (padded rows never
reach the loss, which only counts the real vocabulary).

Writing a layout does not re-derive any sharding rule: for each target pipeline chunk the saver
builds the chunk's model on the ``meta`` device (:func:`~megatron_lite.checkpoint.layout.chunk_model`:
no memory, no init cost), takes its state-dict names and full shapes, and its ``param_meta``
(partition dim and stride of each tensor-parallel parameter, e.g. stride 2 for SwiGLU's
``[gate; up]`` fc1), then cuts every full tensor with :func:`~megatron_lite.parallel.tensor.shard`,
the function the layers themselves use to take their slice of the initial weights. The fused QKV
weight is ``[groups, (heads_per_group + 2) * head_dim, hidden]`` with whole key/value groups per
rank, so a contiguous split is exact for any TP dividing the number of groups. A tied model's last
pipeline stage gets its copy of the word embedding as ``output_layer.weight``, as in training (with
multi-token prediction as ``embedding.word_embeddings.weight``, which that stage then holds).
Each expert-parallel rank gets its experts (:mod:`~megatron_lite.checkpoint.layout`) in its own
``mp_rank_TT_PPP_EEE`` file.

The FP8 bookkeeping of an ``--fp8-format`` run (each FP8 gemm's amax history and scales) is kept:
it belongs to one layer's gemm (one expert's, under its global number), and training reduces the
amaxes over tensor and data parallelism, so every rank of any layout holds the one-process values;
the target chunks are built with the run's FP8 recipe and every TP rank gets the whole buffers. A
resumed FP8 run then quantises with the learned scales, as it would have without the conversion; a
run without FP8 ignores them, and the Hugging Face export leaves them out.

The optimizer state (Adam moments, fp32 masters, loss scaler) is resharded the same way
(:mod:`~megatron_lite.checkpoint.reshard_optim`) and the learning-rate schedule copied, with the
source's iteration and consumed samples: resume with ``--no-load-rng`` (RNG states are per rank and
do not carry over to another layout). A source without optimizer state gives model files with
``optimizer`` None: resume with ``--no-load-optim --no-load-rng``, or ``--finetune``.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
from dataclasses import dataclass, field

import torch

from ..console import print_rank_0
from ..errors import ConfigError
from ..files import remove_stale_temps
from ..parallel.expert_grid import is_folded
from ..parallel.pipeline.partition import pipeline_ranges
from ..parallel.tensor import padded_vocab_size, shard
from ..precision.fp8 import is_fp8_state_key
from .dist_read import is_dist_folder, merge_dist_optimizer, resolve_folder
from .expert_files import folded_files, is_expert_tensor
from .format import (
    ASIDE_PREFIX,
    FORMAT_VERSION,
    TRACKER_FILENAME,
    VOCAB_TENSORS,
    CheckpointError,
    atomic_save,
    atomic_write_text,
    find_model_files,
    iteration_dir,
    iteration_folders,
    model_file,
    param_meta,
    read_tracker,
    temp_dir,
    with_checksums,
)
from .hf_io import TOKENIZER_DIR, tokenizer_files_in
from .layout import (
    check_expert_size,
    check_expert_tensor_size,
    check_names,
    chunk_model,
    ep_name,
    ep_slice,
    global_name,
    num_experts,
    transformer_config,
)
from .merge import merge_checkpoint, model_config_from_saved
from .reshard_optim import merge_optimizer, split_optimizer


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
    adapters: dict | None = None  # a LoRA checkpoint's adapters (single-process names); state_dict is its base

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
# Loader: a megatron_lite checkpoint of any TP x PP (x VPP) x EP layout.


def load_megatron(load_dir: str, progress=_no_progress) -> ModelBundle:
    """The bundle of a megatron_lite checkpoint (save folder's latest iteration, or an ``iter_*`` folder).

    Tokenizer files to carry along: those in ``<load_dir>/tokenizer/`` and the files the saved
    config's ``--vocab-file`` / ``--merge-file`` / ``--tokenizer-model`` name, when they exist."""
    filled: list = []  # MoE router biases the checkpoint lacks (zero): its optimizer state does not fit
    state_dict, config = merge_checkpoint(load_dir, filled)
    iteration = config.pop("iteration", None)
    consumed = config.pop("consumed_samples", 0) or 0
    if iteration is None:
        iteration = read_tracker(load_dir) or "release"
    vocab = config.get("vocab_size") or config["padded_vocab_size"]
    config["vocab_size"], config["padded_vocab_size"] = vocab, None
    files = tokenizer_files_in(os.path.join(load_dir, TOKENIZER_DIR))  # kept by an earlier conversion
    for key, name in (("vocab_file", "vocab.json"), ("merge_file", "merges.txt")):
        if config.get(key) and os.path.isfile(config[key]):
            # a WordPiece vocabulary (BERT) is a vocab.txt, as Hugging Face names it
            files["vocab.txt" if key == "vocab_file" and config[key].endswith(".txt") else name] = config[key]
    model = config.get("tokenizer_model")
    if model and os.path.isdir(model):  # HuggingFaceTokenizer takes the folder that holds tokenizer.json
        model = os.path.join(model, "tokenizer.json")
    if model and os.path.isfile(model) and config.get("tokenizer_type") != "TikTokenizer":  # (not a tokenizer.json:
        files["tokenizer.json" if model.endswith(".json") else "tokenizer.model"] = model  # the config names it)
    from ..lora.convert import is_lora_config, read_lora_checkpoint  # (lora/convert.py imports this package)

    if is_lora_config(config):  # adapters only: the base's weights come from the checkpoint it records
        adapters, state_dict, _ = read_lora_checkpoint(load_dir, state_dict, config)
        return ModelBundle(config, unpad_vocab(state_dict, vocab), iteration, int(consumed), files, None, adapters)
    if filled:
        print_rank_0("  its optimizer state is left out (resume the converted checkpoint with --no-load-optim)")
        return ModelBundle(config, unpad_vocab(state_dict, vocab), iteration, int(consumed), files, None)
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
    return [(chunk_model(payload["config"], pp_rank == 0 and c == 0, pp_rank == last and c == len(ranges) - 1, s, e), s)
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
    layout: str | None = None  # --pipeline-model-parallel-layout
    account_embedding: bool = False  # --account-for-embedding-in-pipeline-split
    account_loss: bool = False  # --account-for-loss-in-pipeline-split
    ep: int = 1  # --expert-model-parallel-size
    etp: int | None = None  # --expert-tensor-parallel-size (None: TP)
    dp: int | None = None  # data-parallel size of the run that loads it (None: one EP divides)

    @property
    def etp_size(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def folded(self) -> bool:
        """Whether the experts need their own grid (megatron_lite/parallel/expert_grid.py): the files are
        then ``mp_rank_TT_PPP_EEE_XX`` (:mod:`.expert_files`)."""
        return is_folded(self.tp, 1, self.ep if self.dp is None else self.dp, self.ep, self.etp)

    def files(self) -> list[tuple[int, int, int | None]]:
        """``(tp, ep, etp)`` ranks of the files of one pipeline stage (``etp`` None: not folded)."""
        if self.folded:
            return folded_files(self.tp, self.ep, self.etp_size)
        return [(t, e, None) for e in range(self.ep) for t in range(self.tp)]


def target_config(bundle: ModelBundle, layout: TargetLayout) -> dict:
    """The flat config the target checkpoint records: the bundle's, with the new layout and padding.
    MoE at TP > 1 records ``sequence_parallel`` (its layers need it)."""
    cfg = dict(bundle.config)
    model = model_config_from_saved({**cfg, "padded_vocab_size": 0})
    padded = padded_vocab_size(model.vocab_size, model.make_vocab_size_divisible_by, layout.tp)
    check_expert_size(cfg, layout.ep)
    check_expert_tensor_size(cfg, layout.tp, layout.ep, layout.etp, layout.dp)
    split = dict(  # the pipeline split flags the target records; its ranges come from them
        pipeline_model_parallel_size=layout.pp, num_layers_per_virtual_pipeline_stage=layout.vpp_layers,
        decoder_first_pipeline_num_layers=layout.first, decoder_last_pipeline_num_layers=layout.last,
        pipeline_model_parallel_layout=layout.layout, account_for_embedding_in_pipeline_split=layout.account_embedding,
        account_for_loss_in_pipeline_split=layout.account_loss,
    )
    try:  # the model's own shape rules, at the target TP and EP sizes
        transformer_config({**cfg, "padded_vocab_size": padded}, layout.tp, layout.ep)
        ranges = pipeline_ranges({**cfg, **split, "num_layers": model.num_layers})
    except (ConfigError, ValueError) as err:
        etp = "" if layout.etp is None else f" x etp {layout.etp}"
        raise ConfigError(f"target layout tp {layout.tp} x pp {layout.pp} x ep {layout.ep}{etp}: {err}") from None
    sp = (bool(cfg.get("sequence_parallel")) or bool(num_experts(cfg))) and layout.tp > 1
    cfg.update(
        padded_vocab_size=padded, tensor_model_parallel_size=layout.tp, sequence_parallel=sp,
        expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.etp, **split,
    )
    cfg["_ranges"] = ranges
    return cfg


def _full_tensor(bundle: ModelBundle, name: str, start: int, padded: int, table: dict | None = None) -> torch.Tensor:
    """The full tensor for chunk-local ``name`` (layer numbers are chunk-local) from ``table``
    (default: the bundle's weights; an optimizer state table has the same names)."""
    table = bundle.state_dict if table is None else table
    key = global_name(name, start)
    if name == "output_layer.weight" and bundle.tied:
        key = "embedding.word_embeddings.weight"  # the last stage's copy of the tied embedding
    if key not in table:
        raise CheckpointError(f"the source has no tensor {key}; it does not fit the model its config describes")
    tensor = table[key]
    return pad_vocab(tensor, padded) if name in VOCAB_TENSORS else tensor


def _chunk_shards(bundle, cfg, chunk, start, layout, ep_rank, etp_rank) -> tuple[list[dict], dict]:
    """(per-TP-rank state dicts, param_meta) of one chunk (an EP-1 meta model) on expert rank ``ep_rank``;
    on a folded grid the experts are cut over ETP (``etp_rank``'s shard in every TP rank's dict)."""
    meta, tp, experts = param_meta(chunk), layout.tp, num_experts(cfg)
    shards, local_meta = [{} for _ in range(tp)], {}
    for name, expected in chunk.state_dict().items():
        local = ep_name(name, ep_rank, layout.ep, experts)
        if local is None:
            continue  # an expert of another EP rank
        full = _full_tensor(bundle, name, start, cfg["padded_vocab_size"])
        if tuple(full.shape) != tuple(expected.shape):
            raise CheckpointError(f"source tensor for {name} has shape {tuple(full.shape)}, the model needs "
                                  f"{tuple(expected.shape)}; the weights do not fit the config")
        full = ep_slice(name, full, ep_rank, layout.ep)
        if name in meta:
            local_meta[local] = meta[name]
        for t in range(tp):
            rank, size = (etp_rank, layout.etp_size) if etp_rank is not None and is_expert_tensor(name) else (t, tp)
            part = shard(full, meta[name]["partition_dim"], rank, size, meta[name]["partition_stride"]) if name in meta else full
            shards[t][local] = part.clone()
    return shards, local_meta


def _payload(bundle, cfg, layout, models, ranges, t, e, x) -> dict:
    """The model file of TP rank ``t``, EP rank ``e`` (and, folded, ETP rank ``x``) of one pipeline
    stage (``models``: its chunks)."""
    per_chunk = [_chunk_shards(bundle, cfg, model, s, layout, e, x) for model, s in models]
    padded, iteration = cfg["padded_vocab_size"], bundle.iteration
    # the fewest data-parallel ranks that hold the layout (not a run's: only the folded files depend on it)
    dp = layout.dp or (math.lcm(layout.tp, layout.etp_size * layout.ep) // layout.tp if x is not None else layout.ep)
    return {
        "iteration": 0 if iteration == "release" else int(iteration),
        "consumed_samples": int(bundle.consumed_samples),
        "config": cfg,
        "tp_size": layout.tp, "pp_size": layout.pp, "ep_size": layout.ep, "dp_size": dp,
        "etp_size": layout.etp_size, "expert_grid_folded": x is not None,
        "vpp_size": len(ranges) if len(ranges) > 1 else None,
        "num_chunks": len(ranges),
        "world_size": layout.tp * layout.pp * dp,
        "model": [shards[t] for shards, _ in per_chunk],
        "param_meta": [meta for _, meta in per_chunk],
        "layer_ranges": [tuple(r) for r in ranges],
        "optimizer": None if bundle.optimizer is None else split_optimizer(
            bundle.optimizer, models, t, layout.tp, lambda name, table: _full_tensor(bundle, name, 0, padded, table),
            ep_rank=e, ep_size=layout.ep, experts=num_experts(cfg), etp=None if x is None else (x, layout.etp_size)),
        "scheduler": None if bundle.optimizer is None else bundle.optimizer["scheduler"],
        "format_version": FORMAT_VERSION,
    }


def _asides(save_dir: str) -> list[str]:
    """The ``.old_iter_N`` folders under ``save_dir`` (see checkpoint/dist_save.py finalize_save)."""
    if not os.path.isdir(save_dir):
        return []
    return sorted(n for n in os.listdir(save_dir) if n.startswith(ASIDE_PREFIX) and os.path.isdir(os.path.join(save_dir, n)))


def _write_files(bundle, cfg, layout, ranges, fp8, save_dir, folder, progress) -> None:
    """Every model file of ``layout`` (its path under ``iter_N`` of ``save_dir``) written in ``folder``."""
    chunks_per_rank, iteration = len(ranges[0]), bundle.iteration
    # a folded grid's experts are cut over ETP (even of one rank), as training marks them
    built = {**cfg, "expert_tensor_parallel_size": None} if layout.folded else cfg
    for p in progress(range(layout.pp), desc="pipeline stages", unit="stage"):
        models = [(chunk_model(built, p == 0 and c == 0, p == layout.pp - 1 and c == chunks_per_rank - 1, s, e, fp8), s)
                  for c, (s, e) in enumerate(ranges[p])]
        for t, e, x in layout.files():
            payload = _payload(bundle, cfg, layout, models, ranges[p], t, e, x)
            path = model_file(save_dir, iteration, t, p, e if layout.ep > 1 or x is not None else None, x)
            atomic_save(with_checksums(payload), os.path.join(folder, os.path.relpath(path, iteration_dir(save_dir, iteration))))


def _place(staged: str, folder: str) -> None:
    """Move the staged folder's files into ``folder`` (renames: the files are complete)."""
    if not os.path.isdir(staged):
        return
    if not os.path.lexists(folder):
        os.rename(staged, folder)
        return
    for name in os.listdir(staged):  # a folder an earlier conversion left: its files replaced
        os.replace(os.path.join(staged, name), os.path.join(folder, name))


def save_megatron(bundle: ModelBundle, save_dir: str, layout: TargetLayout, progress=_no_progress,
                  write_tokenizer=None) -> str:
    """Write ``bundle`` as a checkpoint of ``layout`` under ``save_dir`` (tracker last); returns the iteration folder.
    ``write_tokenizer(folder)``: writes the tokenizer files into ``folder``, staged with the model files
    and moved to ``<save_dir>/tokenizer`` before the rename and the tracker (all or nothing)."""
    cfg = target_config(bundle, layout)
    ranges = cfg.pop("_ranges")
    fp8 = any(is_fp8_state_key(k) for k in bundle.state_dict)  # an --fp8-format run's scaling state: kept
    check_names(cfg, bundle.state_dict, fp8)
    iteration = bundle.iteration
    if os.path.isdir(iteration_dir(save_dir, iteration)) and os.listdir(iteration_dir(save_dir, iteration)):
        raise CheckpointError(f"{iteration_dir(save_dir, iteration)} already exists; choose an empty --save-dir")
    held = iteration_folders(save_dir) + _asides(save_dir)  # an aside is a checkpoint a save set aside
    held += [TRACKER_FILENAME] if os.path.lexists(os.path.join(save_dir, TRACKER_FILENAME)) else []
    if held:  # its tracker would be moved to this iteration: a run resuming there would go back silently
        raise CheckpointError(f"{save_dir} already holds checkpoints ({', '.join(held[-3:])}); choose an empty --save-dir")
    # written into .tmp_iter_N (what a conversion killed earlier left there is removed first) and
    # renamed to iter_N once every file is complete: a failure leaves no half-written iter_N
    final, tmp = iteration_dir(save_dir, iteration), temp_dir(save_dir, iteration)
    created = not os.path.lexists(save_dir)  # removed again (once empty) if the conversion fails
    if os.path.lexists(tmp):
        shutil.rmtree(tmp)
    remove_stale_temps(save_dir, (TRACKER_FILENAME,))  # the tracker's, of a conversion killed before its rename
    tokenizer = os.path.join(save_dir, TOKENIZER_DIR)
    placed = not os.path.lexists(tokenizer) and write_tokenizer is not None  # ours to remove on a failure
    try:
        _write_files(bundle, cfg, layout, ranges, fp8, save_dir, tmp, progress)
        if write_tokenizer is not None:
            write_tokenizer(os.path.join(tmp, TOKENIZER_DIR))
            _place(os.path.join(tmp, TOKENIZER_DIR), tokenizer)
        os.rename(tmp, final)  # an empty iter_N (allowed above) is replaced
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if placed:
            shutil.rmtree(tokenizer, ignore_errors=True)
        if created:
            with contextlib.suppress(OSError):
                os.rmdir(save_dir)
        raise
    atomic_write_text(os.path.join(save_dir, TRACKER_FILENAME), f"{iteration}\n")
    find_model_files(save_dir)  # reads back the folder listing: every rank's file is in place
    return iteration_dir(save_dir, iteration)
