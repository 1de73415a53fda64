"""Start-up of a training run: distributed init, the parallel state, the seeds, and the startup
summary (backends, layout, FP8 path, a warning for 16-bit math a CPU emulates)."""

from __future__ import annotations

import torch

from ..config import Config
from ..console import print_rank_0
from ..device import cpu_has_native, describe_backends, init_distributed
from ..fusions.compile import configure_compilation
from ..models.transformer_config import TransformerConfig
from ..moe.config import expert_grid_tp
from ..parallel.pipeline import pipeline_ranges
from ..parallel.random import model_parallel_seed
from ..parallel.state import ParallelState
from ..perf.host_memory import retain_freed_host_memory
from ..precision.fp8_describe import describe_fp8_path
from .dp_random_init import seed_offset


def half_precision_warning(config: Config, device: torch.device) -> str | None:
    """A startup warning when --bf16/--fp16 runs on a CPU that emulates that dtype (slower than fp32)."""
    dtype = config.precision.params_dtype
    if device.type != "cpu" or dtype == torch.float32 or cpu_has_native(dtype):
        return None
    flag = "--bf16" if dtype == torch.bfloat16 else "--fp16"
    return (f"WARNING: {flag} on a CPU without native {flag[2:]} instructions: 16-bit math is emulated and runs "
            "several times slower than fp32 here (it saves memory only); drop the flag for speed")


def setup(config: Config) -> tuple[ParallelState, torch.device]:
    """Distributed init, the parallel state and the seeds; prints the startup summary."""
    device = init_distributed(config.parallel.distributed_timeout_minutes, config.parallel.distributed_backend)
    if device.type == "cpu" and config.fusion.retain_host_memory and retain_freed_host_memory():
        print_rank_0("> host memory: freed blocks kept for reuse (--no-retain-host-memory gives them back)")
    p = config.parallel
    chunks = len(pipeline_ranges(config.flat())[0])
    vpp = chunks if chunks > 1 else None
    state = ParallelState(
        tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size, cp=p.context_parallel_size,
        ep=p.expert_model_parallel_size, vpp=vpp, dist_opt_instances=p.num_distributed_optimizer_instances,
        hcp=p.hierarchical_context_parallel_sizes, etp=expert_grid_tp(config),
    )
    model_parallel_seed(config.training.seed + seed_offset(config, state), state)  # --data-parallel-random-init
    configure_compilation(config.fusion, device.type)
    print_rank_0(f"> {describe_backends()}")
    print_rank_0(f"> parallel layout: {state.describe()}")
    if config.precision.transformer_impl == "transformer_engine":
        print_rank_0("> transformer layers' GEMMs through Transformer Engine (linear layers only)")
    elif config.precision.fp8_format is not None:
        model = TransformerConfig.from_config(config)
        print_rank_0(f"> {describe_fp8_path(model.fp8_scaling_recipe(), device)}; {model.describe_fp8()}")
    warning = half_precision_warning(config, device)
    if warning:
        print_rank_0(warning)
    return state, device
