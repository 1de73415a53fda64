"""The precision-aware optimizer (``--use-precision-aware-optimizer``): Adam's moments stored in bf16.

Megatron-LM's flag (with ``--exp-avg-dtype`` / ``--exp-avg-sq-dtype``) keeps Adam's two moments in a
16-bit dtype between steps to save memory (DeepSeek-V3 trains with bf16 moments); the update itself
is computed in fp32. Here:

* **Storage.** Between steps each moment of each fp32 master (the distributed optimizer's flat
  pieces) lives in its ``--exp-avg(-sq)-dtype`` tensor in the torch optimizer's ``state``: that is
  what checkpoints save (in that dtype), what ``--memory-report`` counts, and what the optimizer's
  CPU offload keeps on the host.
* **The step.** :class:`PrecisionAwareAdamW` steps its parameters a chunk at a time (at most
  ``CHUNK_NUMEL`` elements): the chunk's moments are upcast to fp32 (exact), PyTorch's AdamW (fused
  where it can be) updates master and moments in fp32 exactly as without the flag, and each moment is
  then **rounded to its storage dtype** (round to nearest even, ``Tensor.copy_``) into its stored
  tensor. That rounding, once per moment per step, is the only difference from fp32 Adam: one step
  equals an fp32 Adam step whose moments are afterwards rounded to bf16. The chunking bounds the fp32
  copies alive at once (so the peak does not return to fp32 moments).
* **Scope** (as in Megatron-LM): ``--optimizer adam`` with the distributed optimizer
  (``--use-distributed-optimizer`` or a sharded ``--data-parallel-sharding-strategy``), CPU offload
  included. Master weights and main gradients stay fp32: ``--main-params-dtype fp16`` and
  ``--main-grads-dtype bf16`` are refused, and so are fp16 / fp8 moments, which need a per-tensor
  scale (Megatron-LM's Transformer Engine Adam keeps one) that is not built.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError

MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""The ``--exp-avg-dtype`` / ``--exp-avg-sq-dtype`` values taken (fp16 and fp8 are refused by value)."""

CHUNK_NUMEL = 1 << 24
"""Elements stepped at once (their fp32 moment copies, 2 x 64 MiB, are the step's transient memory)."""


def moment_dtypes(precision) -> dict[str, torch.dtype]:
    """``{"exp_avg": dtype, "exp_avg_sq": dtype}`` the run stores Adam's moments in (empty: fp32 Adam, also
    with --use-precision-aware-optimizer and both moments fp32)."""
    if precision is None or not getattr(precision, "use_precision_aware_optimizer", False):
        return {}
    dtypes = {"exp_avg": MOMENT_DTYPES[precision.exp_avg_dtype], "exp_avg_sq": MOMENT_DTYPES[precision.exp_avg_sq_dtype]}
    return dtypes if set(dtypes.values()) != {torch.float32} else {}


def moment_bytes(precision) -> int:
    """Bytes per element of Adam's two moments together (8 for fp32 Adam, 4 with both in bf16)."""
    dtypes = moment_dtypes(precision) or {"exp_avg": torch.float32, "exp_avg_sq": torch.float32}
    return sum(torch.empty((), dtype=d).element_size() for d in dtypes.values())


def check_precision_aware_flags(config) -> None:
    """The precision-aware optimizer's flags and what it needs; ConfigError with one line."""
    pr, o, p = config.precision, config.optim, config.parallel
    low = [(flag, value) for flag, value in (("--exp-avg-dtype", pr.exp_avg_dtype),
                                              ("--exp-avg-sq-dtype", pr.exp_avg_sq_dtype)) if value != "fp32"]
    if not pr.use_precision_aware_optimizer:
        if low:
            flag, value = low[0]
            raise ConfigError(f"{flag} {value} needs --use-precision-aware-optimizer (as in Megatron-LM); add it or "
                              f"use {flag} fp32")
        return
    if o.optimizer != "adam":
        raise ConfigError(f"--use-precision-aware-optimizer with --optimizer {o.optimizer}: it stores Adam's moments "
                          "only (as in Megatron-LM); use --optimizer adam or drop it")
    if not (p.use_distributed_optimizer or p.data_parallel_sharding_strategy != "no_shard"):
        raise ConfigError("--use-precision-aware-optimizer needs the distributed optimizer (as in Megatron-LM); add "
                          "--use-distributed-optimizer")


def _chunks(groups, limit: int):
    """``groups`` cut into lists of sub-groups (same hyper-parameters) of at most ``limit`` elements each
    (a tensor larger than ``limit`` is a chunk of its own)."""
    chunk, size = [], 0
    for group in groups:
        params = []
        for p in group["params"]:
            if size and size + p.numel() > limit:
                if params:
                    chunk.append(dict(group, params=params))
                yield chunk
                chunk, size, params = [], 0, []
            params.append(p)
            size += p.numel()
        if params:
            chunk.append(dict(group, params=params))
    if chunk:
        yield chunk


class PrecisionAwareAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` whose moments are stored in ``moment_dtypes`` between steps (module docstring)."""

    def __init__(self, params, *, moment_dtypes: dict[str, torch.dtype], chunk_numel: int = CHUNK_NUMEL, **kwargs):
        super().__init__(params, **kwargs)
        self.moment_dtypes, self.chunk_numel = dict(moment_dtypes), chunk_numel

    def _upcast(self, groups) -> dict:
        """Replace the stored moments of ``groups``' params by fp32 copies; returns the stored tensors."""
        stored = {}
        for group in groups:
            for p in group["params"]:
                state = self.state.get(p)
                for key in self.moment_dtypes if state else ():
                    if key in state and state[key].dtype != torch.float32:
                        stored[(p, key)] = state[key]
                        state[key] = state[key].float()
        return stored

    def _round_back(self, groups, stored: dict) -> None:
        """Round each fp32 moment of ``groups``' params to its storage dtype (into its stored tensor)."""
        for group in groups:
            for p in group["params"]:
                state = self.state.get(p)
                for key, dtype in self.moment_dtypes.items() if state else ():
                    if key not in state or state[key].dtype == dtype:
                        continue
                    low = stored.get((p, key))
                    state[key] = low.copy_(state[key]) if low is not None else state[key].to(dtype)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("PrecisionAwareAdamW.step takes no closure")
        groups = self.param_groups
        try:
            for chunk in _chunks(groups, self.chunk_numel):
                stored = self._upcast(chunk)
                self.param_groups = chunk
                super().step()
                self._round_back(chunk, stored)
        finally:
            self.param_groups = groups

    def load_state_dict(self, state_dict) -> None:
        """torch casts loaded moments to the param dtype (fp32); store them in their dtype again."""
        super().load_state_dict(state_dict)
        self._round_back(self.param_groups, {})
