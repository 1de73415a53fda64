"""What a --ckpt-format torch resume checks before it loads: the parallel sizes, the virtual pipeline,
each chunk's layer range, and every tensor's name and shape; one CheckpointError naming what differs
(and the model flags that explain it, when the saved config says so)."""

from __future__ import annotations

import torch

from .arch import arch_differences, check_family
from .expert_files import check_expert_grid
from .format import CheckpointError
from .frozen import saved_state_dict


def layer_range(module):
    """(layer_start, layer_end) of a chunk: GPTModel keeps them on its ``decoder``; None if unknown."""
    holder = module if hasattr(module, "layer_start") else getattr(module, "decoder", None)
    start, end = getattr(holder, "layer_start", None), getattr(holder, "layer_end", None)
    return None if start is None else (int(start), None if end is None else int(end))


def _flag_mismatch(path, what, saved, ours, flag) -> CheckpointError:
    return CheckpointError(f"checkpoint {path} was saved with {what} {saved}, this run uses {ours}; convert it or match {flag}")


def check_sizes(path: str, ckpt: dict, state) -> None:
    check_expert_grid(path, ckpt, state)
    for key, name, ours in (("tp_size", "tensor-model-parallel-size", state.tp_size),
                            ("pp_size", "pipeline-model-parallel-size", state.pp_size),
                            ("ep_size", "expert-model-parallel-size", state.ep_size)):
        if ckpt.get(key, 1) != ours:  # files from before expert parallelism have no ep_size
            raise _flag_mismatch(path, name, ckpt.get(key, 1), ours, f"--{name}")


def check_compatible(path: str, ckpt: dict, modules, config, state) -> None:
    """Raise one CheckpointError naming what differs between the checkpoint and this run."""
    check_family(path, ckpt.get("config", {}), config)
    check_sizes(path, ckpt, state)
    saved_chunks = ckpt.get("num_chunks", len(ckpt["model"]))
    if saved_chunks != len(modules) or ckpt.get("vpp_size") != state.vpp_size:
        raise _flag_mismatch(path, "virtual pipeline size", f"{ckpt.get('vpp_size')} ({saved_chunks} model chunks per rank)",
                             f"{state.vpp_size} ({len(modules)} model chunks per rank)",
                             "--num-layers-per-virtual-pipeline-stage")
    ours_ranges = [layer_range(m) for m in modules]
    saved_ranges = [tuple(r) if r is not None else None for r in ckpt.get("layer_ranges", ours_ranges)]
    if saved_ranges != ours_ranges:
        raise _flag_mismatch(path, "layer ranges", saved_ranges, ours_ranges,
                             "--num-layers and --decoder-first/last-pipeline-num-layers")
    problems, differing = [], 0  # lines of the message; tensors that differ
    for i, (module, saved) in enumerate(zip(modules, ckpt["model"])):
        where = f"chunk {i} " if len(modules) > 1 else ""
        mine = saved_state_dict(module)
        missing = [k for k in mine if k not in saved]
        extra = [k for k in saved if k not in mine]
        differing += len(missing) + len(extra)
        if missing:
            problems.append(f"{where}missing in checkpoint: {', '.join(missing[:4])}" + (" ..." if len(missing) > 4 else ""))
        if extra:
            problems.append(f"{where}not in this model: {', '.join(extra[:4])}" + (" ..." if len(extra) > 4 else ""))
        for key, tensor in mine.items():
            if key in saved and torch.is_tensor(tensor) and tuple(saved[key].shape) != tuple(tensor.shape):
                differing += 1
                problems.append(f"{where}{key} has shape {tuple(saved[key].shape)} in the checkpoint, "
                                f"{tuple(tensor.shape)} in this model")
    if problems:
        arch = arch_differences(ckpt.get("config", {}), config)
        if arch:  # the flags explain it: name them first, one example of the consequence
            what = (f"it was saved with {', '.join(arch)}; {differing} tensor(s) differ, "
                    f"e.g. {problems[0]}")
        else:
            what = "; ".join(problems[:5] + ([f"and {len(problems) - 5} more"] if len(problems) > 5 else []))
        raise CheckpointError(f"checkpoint {path} does not match the model: {what}; match the model flags")
