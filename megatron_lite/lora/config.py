"""The LoRA flags (``--lora-*``, Megatron-Bridge's names and defaults) and their validation.

:class:`LoRAConfig` is one section of the run's Config. LoRA is off unless ``--lora-rank`` is given.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ConfigError

DEFAULT_TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
# column-parallel bases (MoE experts' fc1 included; the last three: multi-latent attention's projections)
COLUMN_TARGETS = ("linear_qkv", "linear_fc1", "linear_q_proj", "linear_q_up_proj", "linear_kv_up_proj")
ROW_TARGETS = ("linear_proj", "linear_fc2")  # row-parallel bases (MoE experts' fc2 included)


@dataclass
class LoRAConfig:
    lora_rank: int | None = None
    """LoRA: train rank-r adapters on the target linear layers, base weights frozen (off when not given; Megatron-Bridge uses 32)."""
    lora_alpha: float = 32.0
    """LoRA scale numerator: an adapter adds (alpha / rank) B A x."""
    lora_dropout: float = 0.0
    """Dropout on the adapters' input."""
    lora_target_modules: list[str] | None = field(default_factory=lambda: list(DEFAULT_TARGETS))
    """Linear layers that get adapters, space- or comma-separated (experts' fc1/fc2 included; MLA: linear_q_proj, linear_q_up_proj, linear_kv_up_proj)."""


def model_targets(mla: bool, q_lora_rank: int | None) -> tuple[str, ...]:
    """The target names a model has layers of: multi-latent attention (``mla``) has its own projections
    in place of ``linear_qkv`` (``linear_q_proj`` without q compression, else ``linear_q_up_proj``)."""
    if mla:
        q = "linear_q_up_proj" if q_lora_rank is not None else "linear_q_proj"
        return (q, "linear_kv_up_proj", "linear_proj", "linear_fc1", "linear_fc2")
    return ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def _check_targets_of_the_model(lo: LoRAConfig, present: tuple[str, ...]) -> None:
    """A target given on the command line that the model has no layer of is refused (it would get no
    adapter, silently); the default list adapts those the model has (MLA: no ``linear_qkv``)."""
    absent = [t for t in lo.lora_target_modules if t not in present]
    if absent and lo.lora_target_modules != DEFAULT_TARGETS:
        raise ConfigError(f"--lora-target-modules {' '.join(absent)}: this model has no such layer (its targets: "
                          f"{' '.join(present)}); drop it")


def check_lora_flags(config) -> None:
    """One ConfigError naming the flag for a LoRA combination that cannot run."""
    lo = config.lora
    if lo.lora_rank is None:  # an adapter flag alone would leave LoRA off and train the whole model
        default = LoRAConfig()
        for flag in ("lora_alpha", "lora_dropout", "lora_target_modules"):
            if getattr(lo, flag) != getattr(default, flag):
                name = "--" + flag.replace("_", "-")
                raise ConfigError(f"{name} needs --lora-rank (without it LoRA is off and every weight trains); "
                                  f"add --lora-rank R or drop {name}")
        return
    tp = config.parallel.tensor_model_parallel_size
    if lo.lora_rank < 1:
        raise ConfigError(f"--lora-rank must be at least 1, got {lo.lora_rank}")
    if lo.lora_rank % tp:
        raise ConfigError(f"--lora-rank {lo.lora_rank} is not divisible by --tensor-model-parallel-size {tp} "
                          "(the adapters' rank is split over tensor parallelism)")
    if lo.lora_alpha <= 0:
        raise ConfigError(f"--lora-alpha must be positive, got {lo.lora_alpha}")
    if not 0.0 <= lo.lora_dropout < 1.0:
        raise ConfigError(f"--lora-dropout must be in [0, 1), got {lo.lora_dropout}")
    known = COLUMN_TARGETS + ROW_TARGETS
    lo.lora_target_modules = [t for value in lo.lora_target_modules or [] for t in value.split(",") if t]
    unknown = [t for t in lo.lora_target_modules if t not in known]
    if unknown or not lo.lora_target_modules:
        raise ConfigError(f"--lora-target-modules {' '.join(unknown) or '(empty)'}: expected some of {' '.join(known)}")
    _check_targets_of_the_model(lo, model_targets(config.model.multi_latent_attention, config.model.q_lora_rank))
    ck = config.checkpoint
    if not (ck.pretrained_checkpoint or ck.load):
        raise ConfigError("--lora-rank needs the base model to adapt: --pretrained-checkpoint (or --load)")
