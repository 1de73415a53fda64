"""What a --ckpt-format torch resume checks before it loads: the parallel sizes, the virtual pipeline,
each chunk's layer range, and every tensor's name and shape; one CheckpointError naming what differs
(and the model flags that explain it, when the saved config says so)."""

from __future__ import annotations

import shlex

import torch

from .arch import arch_differences, check_family, flag_setting, load_fix
from .expert_files import check_expert_grid
from .format import CheckpointError
from .frozen import saved_state_dict


def layer_range(module):
    """(layer_start, layer_end) of a chunk: GPTModel keeps them on its ``decoder``; None if unknown."""
    holder = module if hasattr(module, "layer_start") else getattr(module, "decoder", None)
    start, end = getattr(holder, "layer_start", None), getattr(holder, "layer_end", None)
    return None if start is None else (int(start), None if end is None else int(end))


CONVERTER = "tools/checkpoint/convert.py"
SPLIT_FLAGS = ("num_layers_per_virtual_pipeline_stage", "decoder_first_pipeline_num_layers",
               "decoder_last_pipeline_num_layers", "pipeline_model_parallel_layout",
               "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")
"""The flags that split the layers over pipeline stages and model chunks (recorded in every checkpoint's config)."""


def _size_mismatch(path, flag, saved, ours) -> CheckpointError:
    """A parallel size the torch format cannot change on load: the saved value, or the converter."""
    target = "--target-" + flag[2:].replace("-model-", "-")  # --tensor-model-parallel-size: --target-tensor-parallel-size
    return CheckpointError(f"checkpoint {path} was saved with {flag} {saved}, this run has {flag} {ours}: pass {flag} "
                           f"{saved}, or convert it with {CONVERTER} {target} {ours}")


def _split_mismatch(path, what, saved_cfg: dict, config, state) -> CheckpointError:
    """The model chunks or layer ranges differ (``what``: both, as words): the --num-layers-per-virtual-pipeline-stage /
    --decoder-first/last-pipeline-num-layers the checkpoint was saved with, or the converter to this run's."""
    ours = config.flat()
    differ = [key for key in SPLIT_FLAGS if key in saved_cfg and saved_cfg.get(key) != ours.get(key)]
    arch = arch_differences(saved_cfg, config)
    if not differ and arch:  # another model (--num-layers): the converter cannot change it
        return CheckpointError(f"checkpoint {path} was saved with {', '.join(arch)}; {load_fix(saved_cfg, config)}")
    if not differ:  # a checkpoint without them: name the flags that decide the split
        return CheckpointError(f"checkpoint {path} was saved with {what}; match --num-layers, "
                               "--num-layers-per-virtual-pipeline-stage, --decoder-first/last-pipeline-num-layers, "
                               "--pipeline-model-parallel-layout and --account-for-embedding/loss-in-pipeline-split "
                               f"to the run that saved it, or convert it with {CONVERTER}")
    saved_words = [flag_setting(key, saved_cfg) for key in differ]
    give = " ".join(words for _, words in saved_words if words)
    drop = " ".join(flag_setting(key, ours)[1] for key, (_, words) in zip(differ, saved_words) if not words)
    fix = " and ".join(([f"pass {give}"] if give else []) + ([f"drop {drop}"] if drop else []))
    target = " ".join(f"--target-{key.replace('_', '-')}" + ("" if ours[key] is True else f" {shlex.quote(str(ours[key]))}")
                      for key in differ if ours.get(key) not in (None, False))
    return CheckpointError(f"checkpoint {path} was saved with {what} ({', '.join(said for said, _ in saved_words)}): "
                           f"{fix}, or convert it with {CONVERTER} --target-pipeline-parallel-size {state.pp_size}"
                           + (f" {target}" if target else ""))


def check_sizes(path: str, ckpt: dict, state) -> None:
    check_expert_grid(path, ckpt, state)
    for key, name, ours in (("tp_size", "tensor-model-parallel-size", state.tp_size),
                            ("pp_size", "pipeline-model-parallel-size", state.pp_size),
                            ("ep_size", "expert-model-parallel-size", state.ep_size)):
        if ckpt.get(key, 1) != ours:  # files from before expert parallelism have no ep_size
            raise _size_mismatch(path, f"--{name}", ckpt.get(key, 1), ours)


def check_compatible(path: str, ckpt: dict, modules, config, state) -> None:
    """Raise one CheckpointError naming what differs between the checkpoint and this run."""
    check_family(path, ckpt.get("config", {}), config)
    check_sizes(path, ckpt, state)
    saved_chunks = ckpt.get("num_chunks", len(ckpt["model"]))
    if saved_chunks != len(modules) or ckpt.get("vpp_size") != state.vpp_size:
        raise _split_mismatch(path, f"{saved_chunks} model chunks per rank, this run has {len(modules)}",
                              ckpt.get("config", {}), config, state)
    ours_ranges = [layer_range(m) for m in modules]
    saved_ranges = [tuple(r) if r is not None else None for r in ckpt.get("layer_ranges", ours_ranges)]
    if saved_ranges != ours_ranges:
        raise _split_mismatch(path, f"layer ranges {saved_ranges} on this rank, this run has {ours_ranges}",
                              ckpt.get("config", {}), config, state)
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
        fix = load_fix(ckpt.get("config", {}), config) if arch else "match the model flags of the run that saved it"
        raise CheckpointError(f"checkpoint {path} does not match the model: {what}; {fix}")
