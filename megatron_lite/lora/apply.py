"""Turn a built model chunk into a LoRA model: adapters on the target linears, every base weight frozen.

:func:`apply_lora` runs on each model chunk after it is built and before it is wrapped for data
parallelism (Megatron-Bridge's order: freeze, then transform, then DDP). Inside every transformer
layer, a :class:`~megatron_lite.parallel.tensor.ColumnParallelLinear` or
:class:`~megatron_lite.parallel.tensor.RowParallelLinear` whose attribute name is in
``--lora-target-modules`` gets a :class:`~megatron_lite.lora.adapters.LinearAdapter` (shared experts
included), and the MoE experts get one adapter per expert on fc1 / fc2
(:mod:`megatron_lite.lora.experts`). The embedding, output layer, norms and router are not adapted.

Then every parameter that is not an adapter weight gets ``requires_grad = False``. Nothing else is
LoRA-specific: the data-parallel gradient buffer, the optimizers (plain, distributed, ZeRO-1/2/3) and
the gradient norm all take only parameters that require gradients, and checkpoints save only those
(frozen weights come from the base checkpoint, :mod:`megatron_lite.checkpoint.frozen`).
"""

from __future__ import annotations

from torch import nn

from ..errors import ConfigError
from ..models.transformer import TransformerLayer
from ..models.transformer_config import TransformerConfig
from ..moe.experts import GroupedExperts, SequentialExperts
from ..parallel.tensor import ColumnParallelLinear, RowParallelLinear
from .adapters import LinearAdapter
from .experts import add_expert_adapters


def is_adapter_name(name: str) -> bool:
    """Whether a state-dict name is a LoRA adapter weight's."""
    return ".adapter." in name or "_adapter." in name


def _adapt_layer(layer: TransformerLayer, config, lora, state) -> int:
    targets, count = set(lora.lora_target_modules), 0
    for name, module in layer.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, (SequentialExperts, GroupedExperts)):
            count += add_expert_adapters(module, config, lora, layer.layer_number, targets, state.rng_tracker)
        elif leaf in targets and isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            kind = "column" if isinstance(module, ColumnParallelLinear) else "row"
            module.adapter = LinearAdapter(module, kind, config, lora, layer.layer_number, name, state.rng_tracker)
            count += 1
    return count


def apply_lora(chunk: nn.Module, config, lora, state) -> nn.Module:
    """Add adapters to ``chunk``'s transformer layers and freeze everything else (in place; returns it).
    ``config`` is the model's TransformerConfig, ``lora`` the LoRAConfig section."""
    count = 0
    layers = [m for m in chunk.modules() if isinstance(m, TransformerLayer)]
    for layer in layers:
        count += _adapt_layer(layer, config, lora, state)
    if layers and not count:
        raise ConfigError(f"--lora-target-modules {' '.join(lora.lora_target_modules)} matches no linear layer "
                          "of this model")
    for param in chunk.parameters():
        param.requires_grad = bool(getattr(param, "lora", False))
    return chunk


def lora_chunks(chunks: list, run_config, state) -> list:
    """The model chunks of a run with ``--lora-rank``, adapted (unchanged without it)."""
    lora = getattr(run_config, "lora", None)
    if lora is None or lora.lora_rank is None:
        return chunks
    model_config = TransformerConfig.from_config(run_config)
    return [apply_lora(chunk, model_config, lora, state) for chunk in chunks]
