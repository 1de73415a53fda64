"""One gradient bucket: a slice of the data-parallel gradient buffer reduced as one tensor.

The bucketing, the sharding strategies and hybrid sharding are described in
:mod:`megatron_lite.parallel.data_parallel`, which builds the buckets; this module holds what one
bucket does: average (all-reduce or reduce-scatter, then the replicas' all-reduce), keep its shard
(sharded gradients), and finish an in-flight all-gather of updated parameters.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from . import comm


class Bucket:
    """A slice of the grad buffer holding whole parameters, reduced as one tensor.

    ``data`` is padded to a multiple of the group size so it can also be reduce-scattered
    (distributed optimizer): rank i of the group then owns ``data.chunk(size)[i]``.
    ``offsets[id(p)]`` is ``(start, end)`` of each param inside ``data``.
    """

    def __init__(self, params: list[nn.Parameter], data: torch.Tensor | None, group, scale: float, offsets: dict,
                 numel: int, device, replicate_group=None):
        self.params, self.data, self.group, self.scale, self.offsets = params, data, group, scale, offsets
        self.numel, self.device = numel, device  # ``data`` is None between uses when grads are sharded
        self.replicate_group = replicate_group  # hybrid sharding: the same shard on the other instances
        self.ids = {id(p) for p in params}
        self.reduce_scatter = False  # set by the distributed optimizer
        self.defer_replicas = False  # sharded grads: the replicas' all-reduce runs once a step, on the shard
        self.grad_shard: torch.Tensor | None = None  # sharded grads: this rank's fp32 chunk, kept all step
        self.param_shard: torch.Tensor | None = None  # sharded params (fsdp.py): this rank's chunk of them
        self.param_gather = None  # an all-gather of updated params still in flight (--overlap-param-gather)
        self.param_data: torch.Tensor | None = None  # the params' flat storage (same layout as ``data``), or None
        self.master_data: torch.Tensor | None = None  # its fp32 master copy (or this rank's chunk of it), optimizer-owned
        self.reset()

    def reset(self) -> None:
        self.ready: set[int] = set()
        self.handle = None
        self.launched = False

    def shard(self) -> tuple[int, int]:
        """``[start, end)`` of ``data`` owned by this rank of the group."""
        n = self.numel // comm.group_size(self.group)
        rank = comm.group_rank(self.group)
        return rank * n, (rank + 1) * n

    def owned_grad(self) -> torch.Tensor:
        """This rank's chunk of the averaged gradient (after the reduce-scatter)."""
        if self.grad_shard is not None:
            return self.grad_shard
        start, end = self.shard()
        return self.data[start:end]

    def allocate(self) -> None:
        """Sharded grads: a zeroed full-size buffer for this backward pass, ``main_grad`` views into it."""
        self.data = torch.zeros(self.numel, dtype=torch.float32, device=self.device)
        for p in self.params:
            a, e = self.offsets[id(p)]
            p.main_grad = self.data[a:e].view(p.shape)

    def keep_shard(self) -> None:
        """Sharded grads, after the reduce-scatter: add this rank's chunk to the shard, drop the buffer."""
        self.wait()
        if self.data is None:  # nothing arrived in this backward pass (every gradient deferred)
            return
        start, end = self.shard()
        self.grad_shard.add_(self.data[start:end])
        self.data = None
        for p in self.params:
            p.main_grad = None

    @torch.no_grad()
    def flatten_params(self) -> None:
        """If all its params have one dtype, they become views of one flat buffer laid out like the
        bucket's gradients (``param_data``): the optimizer then writes updated 16-bit params with
        one copy per bucket, and the distributed optimizer all-gathers straight into it."""
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            return
        flat = torch.zeros(self.numel, dtype=dtypes.pop(), device=self.device)
        for p in self.params:
            a, e = self.offsets[id(p)]
            flat[a:e].copy_(p.detach().reshape(-1))
            p.data = flat[a:e].view(p.shape)
        self.param_data = flat

    def finish_param_gather(self) -> None:
        """Wait for an in-flight all-gather of updated params and copy them into the model."""
        if self.param_gather is None:
            return
        handle, full = self.param_gather
        self.param_gather = None
        if handle is not None:
            handle.wait()
        if full is None:  # gathered straight into the params' flat storage
            return
        with torch.no_grad():
            for p in self.params:
                a, e = self.offsets[id(p)]
                p.view(-1).copy_(full[a:e])

    def launch(self, async_op: bool) -> None:
        """Average this bucket over its group (divide, then sum; or sum-and-scatter)."""
        self.launched = True
        if self.data is None:  # sharded grads, every gradient of this pass deferred: nothing to reduce
            return
        if self.scale != 1.0:
            self.data.mul_(self.scale)
        if comm.group_size(self.group) == 1:
            self._reduce_over_replicas()
            return
        comm.record("dp", "reduce_scatter" if self.reduce_scatter else "all_reduce", comm.tensor_bytes(self.data),
                    comm.group_size(self.group))
        if self.reduce_scatter:  # in place: this rank's chunk of data receives the sum of the chunks
            start, end = self.shard()
            self.handle = comm.reduce_scatter_single(self.data[start:end], self.data, group=self.group, async_op=async_op)
        else:
            self.handle = dist.all_reduce(self.data, group=self.group, async_op=async_op)
        if not async_op:
            self._reduce_over_replicas()

    def _reduce_over_replicas(self) -> None:
        """Hybrid sharding: sum this rank's shard (or the whole bucket) over the replicate group
        (sharded grads defer it: ``DistributedDataParallel.finish_grad_sync`` sums the shards once a step)."""
        if comm.group_size(self.replicate_group) == 1 or self.defer_replicas:
            return
        start, end = self.shard() if self.reduce_scatter else (0, self.data.numel())
        comm.record("dp", "all_reduce", comm.tensor_bytes(self.data[start:end]), comm.group_size(self.replicate_group))
        dist.all_reduce(self.data[start:end], group=self.replicate_group)

    def wait(self) -> None:
        if self.handle is not None:
            self.handle.wait()
            self.handle = None
            self._reduce_over_replicas()  # an overlapped launch left the second stage for now


def replica_runs(buckets: list[Bucket]) -> list[tuple[object, int, int]]:
    """Sharded grads with hybrid sharding: ``(replicate group, start, end)`` of each run of consecutive
    buckets whose shards are summed over the same replicate group, as ranges of the flat buffer the
    buckets' ``grad_shard`` are consecutive slices of (one all-reduce per run, not per bucket)."""
    runs, start = [], 0
    for b in buckets:
        end = start + b.grad_shard.numel()
        if comm.group_size(b.replicate_group) > 1:
            if runs and runs[-1][0] is b.replicate_group and runs[-1][2] == start:
                runs[-1] = (b.replicate_group, runs[-1][1], end)
            else:
                runs.append((b.replicate_group, start, end))
        start = end
    return runs


def all_reduce_runs(flat: torch.Tensor, runs: list[tuple[object, int, int]]) -> None:
    """Sum each run ``flat[start:end]`` over its group (all launched, then waited for)."""
    handles = []
    for group, start, end in runs:
        comm.record("dp", "all_reduce", comm.tensor_bytes(flat[start:end]), comm.group_size(group))
        handles.append(dist.all_reduce(flat[start:end], group=group, async_op=True))
    for handle in handles:
        handle.wait()
