"""What the offline converter needs to know about a model's layout, read off the model itself.

* :func:`chunk_model` builds one pipeline chunk (a :class:`~megatron_lite.models.GPTModel` or a
  :class:`~megatron_lite.models.BertModel`, with its mixture-of-experts layers) on the ``meta``
  device at tensor- and expert-parallel size 1: its state-dict names, full shapes, parameter order
  and ``param_meta`` (how each tensor-parallel parameter is cut) cost no memory.
* Expert parallelism splits the experts of every MoE layer over the EP ranks (rank ``e`` holds
  experts ``[e * E_local, (e + 1) * E_local)``). At EP 1 the chunk holds every expert under its
  global number, so an EP rank's tensors are a selection of it (:func:`ep_name`): sequential
  experts ``mlp.experts.local_experts.{g}`` are renumbered ``g - e * E_local`` on their rank;
  grouped expert weights (``mlp.experts.weight1`` ... stacked ``[E, ...]``) are sliced along their
  first dimension (:func:`ep_slice`); everything else (dense layers, router and its expert bias,
  shared experts) is whole on every EP rank.
* Layer numbers in a chunk's names are chunk-local (``decoder.layers.{i}``, BERT's
  ``encoder.layers.{i}``); :func:`global_name` adds the chunk's first layer.
"""

from __future__ import annotations

import re

import torch

from ..errors import ConfigError
from ..models import BertModel, GPTModel, TransformerConfig
from ..moe.config import MoEConfig, moe_config_problem, moe_fields, normalize, saved_moe_fields
from ..parallel.state import ParallelState
from .format import CheckpointError
from .merge import model_config_from_saved

LAYER = re.compile(r"^(decoder|encoder)\.layers\.(\d+)\.(.*)$")
SEQUENTIAL_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")
# stacked [E, ...] grouped-expert tensors: the weights and biases, and their LoRA adapters (lora/experts.py)
GROUPED_EXPERT = re.compile(r"^.*\.mlp\.experts\.((weight|bias)[12]|linear_fc[12]_adapter\.linear_(in|out)\.weight)$")


def is_bert(cfg: dict) -> bool:
    """Whether a flat config was saved by pretrain_bert.py (its own section holds ``bert_no_binary_head``)."""
    return "bert_no_binary_head" in cfg


def check_model_type(cfg: dict, model_type: str, where: str) -> None:
    """``--model-type`` must name the family of the checkpoint (one line otherwise)."""
    family = "BERT" if is_bert(cfg) else "GPT"
    if model_type != family:
        raise ConfigError(f"--model-type {model_type}: {where} holds a {family} checkpoint; use --model-type {family}")


def num_experts(cfg: dict) -> int:
    return int(cfg.get("num_experts") or 0)


def transformer_config(cfg: dict, tp: int = 1, ep: int = 1, **run) -> TransformerConfig:
    """The TransformerConfig of a flat config at tensor size ``tp`` and expert size ``ep`` (validated:
    ConfigError or ValueError naming the flag). MoE with TP > 1 runs with sequence parallelism; the
    experts of a folded grid's checkpoint (--expert-tensor-parallel-size neither 1 nor ``tp``) are split
    like the dense layers."""
    moe = MoEConfig(**saved_moe_fields(cfg, fp8=bool(run.get("fp8"))))
    if moe.expert_tensor_parallel_size not in (None, 1, tp):  # saved on a folded expert grid: the models built
        moe.expert_tensor_parallel_size = None  # here hold the experts unfolded, split like the dense layers
    sp = bool(cfg.get("sequence_parallel")) or bool(num_experts(cfg))
    return TransformerConfig.from_model(model_config_from_saved(cfg), tensor_model_parallel_size=tp,
                                        sequence_parallel=sp and tp > 1, expert_model_parallel_size=ep,
                                        **moe_fields(moe), **run)


def fp8_fields(cfg: dict) -> dict:
    """The TransformerConfig FP8 fields a flat config records (``--fp8-format`` and the recipe flags), so
    a chunk holds the FP8 bookkeeping buffers (amax history, scale) of the layers training ran in FP8."""
    keys = ("fp8_recipe", "fp8_margin", "fp8_amax_history_len", "fp8_amax_compute_algo", "first_last_layers_bf16",
            "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16")
    return {"fp8": cfg.get("fp8_format"), "fp8_wgrad": not cfg.get("no_fp8_wgrad", False),
            **{k: cfg[k] for k in keys if cfg.get(k) is not None}}


def chunk_model(cfg: dict, pre: bool = True, post: bool = True, start: int = 0, end: int | None = None,
                fp8: bool = False):
    """One pipeline chunk at TP 1 and EP 1 on the meta device (BERT or GPT, from the config); ``fp8``:
    with the FP8 gemms (and their bookkeeping buffers) of the config's ``--fp8-format`` run."""
    config = transformer_config(cfg, **(fp8_fields(cfg) if fp8 else {}))
    state = ParallelState(world_size=1, rank=0)
    with torch.device("meta"):
        if is_bert(cfg):
            head = not cfg["bert_no_binary_head"]
            return BertModel(config, state, num_tokentypes=2 if head else 0, add_binary_head=head,
                             pre_process=pre, post_process=post, layer_start=start, layer_end=end)
        return GPTModel(config, state, pre_process=pre, post_process=post, layer_start=start, layer_end=end)


def global_name(name: str, start: int) -> str:
    """Chunk-local ``decoder.layers.{i}.x`` (or ``encoder.``) -> global layer ``start + i``."""
    m = LAYER.match(name)
    return f"{m.group(1)}.layers.{start + int(m.group(2))}.{m.group(3)}" if m else name


def local_name(name: str, start: int) -> str:
    """Inverse of :func:`global_name`."""
    m = LAYER.match(name)
    return f"{m.group(1)}.layers.{int(m.group(2)) - start}.{m.group(3)}" if m else name


def ep_name(name: str, ep_rank: int, ep_size: int, experts: int) -> str | None:
    """The name of EP-1 tensor ``name`` in EP rank ``ep_rank``'s files, or None when another rank holds it."""
    m = SEQUENTIAL_EXPERT.match(name)
    if m is None or ep_size == 1:
        return name
    per_rank = experts // ep_size
    g = int(m.group(2))
    return f"{m.group(1)}{g - ep_rank * per_rank}{m.group(3)}" if g // per_rank == ep_rank else None


def ep_slice(name: str, tensor: torch.Tensor, ep_rank: int, ep_size: int) -> torch.Tensor:
    """EP rank ``ep_rank``'s part of a full (EP 1) tensor: its rows of stacked grouped-expert weights."""
    if ep_size == 1 or not GROUPED_EXPERT.match(name):
        return tensor
    return tensor.chunk(ep_size, dim=0)[ep_rank]


def expert_place(name: str, first_experts: dict[str, int], ep_size: int) -> tuple[str, int | None, bool]:
    """Where a tensor of an EP rank sits among every expert (the inverse of :func:`ep_name` and
    :func:`ep_slice`): ``(name with sequential expert j renamed to its global number, first row of a
    stacked grouped-expert tensor along the global expert axis or None, whether it is an expert's)``.
    ``first_experts`` maps each experts module's name prefix (``...mlp.experts.``) to the global
    number of its first local expert."""
    m = SEQUENTIAL_EXPERT.match(name)
    if m:
        first = first_experts.get(m.group(1)[:-len("local_experts.")], 0) if ep_size > 1 else 0
        return f"{m.group(1)}{first + int(m.group(2))}{m.group(3)}", None, True
    if GROUPED_EXPERT.match(name):
        prefix = name[: name.index(".mlp.experts.") + len(".mlp.experts.")]
        return name, first_experts.get(prefix, 0) if ep_size > 1 else 0, True
    return name, None, False


def is_grouped_expert(name: str) -> bool:
    return bool(GROUPED_EXPERT.match(name))


def check_expert_size(cfg: dict, ep: int) -> None:
    """``--target-expert-parallel-size`` must divide the experts (1 for a dense model)."""
    experts = num_experts(cfg)
    if ep < 1:
        raise ConfigError(f"--target-expert-parallel-size must be at least 1, got {ep}")
    if ep > 1 and not experts:
        raise ConfigError(f"--target-expert-parallel-size {ep}: the model has no experts (a dense model); use 1")
    if experts and experts % ep:
        raise ConfigError(f"--target-expert-parallel-size {ep} does not divide --num-experts {experts}")


def check_expert_tensor_size(cfg: dict, tp: int, ep: int, etp: int | None, dp: int | None) -> None:
    """``--target-expert-tensor-parallel-size`` (None: the target TP) and ``--target-data-parallel-size``
    (None: one the target EP divides) must fit the experts: training's own MoE checks at the target sizes."""
    for flag, value in (("--target-expert-tensor-parallel-size", etp), ("--target-data-parallel-size", dp)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be at least 1, got {value}")
        if value is not None and not num_experts(cfg):
            raise ConfigError(f"{flag} {value}: the model has no experts (a dense model); drop it")
    if etp is None or not num_experts(cfg):
        return
    moe = MoEConfig(**saved_moe_fields(cfg))
    normalize(moe, cfg["ffn_hidden_size"])
    moe.expert_tensor_parallel_size = etp
    problem = moe_config_problem(moe, num_layers=cfg["num_layers"], tp=tp, ep=ep, sequence_parallel=True,
                                 fp16=bool(cfg.get("fp16")))
    if problem:
        raise ConfigError(f"--target-expert-tensor-parallel-size {etp}: {problem}")


def check_names(cfg: dict, names, fp8: bool = False) -> None:
    """Every tensor of a bundle must have a place in the model its config describes (``fp8``: with
    the FP8 bookkeeping of its ``--fp8-format`` run)."""
    extra = sorted(set(names) - set(chunk_model(cfg, fp8=fp8).state_dict()))
    if extra:
        raise CheckpointError(f"the source has tensors the model has no place for: {', '.join(extra[:3])}"
                              + (" ..." if len(extra) > 3 else ""))
