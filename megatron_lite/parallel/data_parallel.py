"""Data parallelism: one contiguous fp32 gradient buffer, reduced in buckets during backward.

:class:`DistributedDataParallel` wraps one model chunk. Every trainable parameter gets a
``main_grad`` attribute: an fp32 view into a single flat buffer. A hook on each parameter's
gradient accumulation adds the freshly computed ``param.grad`` (any dtype: bf16/fp16 params too)
into ``main_grad`` in fp32 and frees ``param.grad``, so gradients accumulate over micro-batches in
fp32 without a second copy.

The buffer is laid out in *reverse* registration order, because backward produces gradients
roughly from the last layer to the first: consecutive slices of the buffer ("buckets" of about
``bucket_size`` elements) then become ready one after another. With ``overlap_grad_reduce`` a
bucket's all-reduce is launched asynchronously as soon as all its parameters have reported
(outside :meth:`no_sync`), overlapping communication with the rest of backward;
:meth:`finish_grad_sync` waits for the handles. Without overlap every bucket is reduced in
:meth:`finish_grad_sync`.

Gradients are *averaged* over data-parallel ranks: each bucket is divided by the data-parallel
size, then summed by the all-reduce. With context parallelism (CP) the ranks of a CP group hold
different tokens of the same samples and identical weights, so dense gradients are averaged over
the DP x CP group (divide by dp x cp; the GPT loss is scaled by cp so this is the global token mean).
Expert parameters (attribute ``allreduce=False``) are
sharded over the expert-parallel ranks and replicated only over ``expert_dp_group`` (which spans
CP too); they live in their own buckets, reduced over that group and also divided by dp x cp (the
expert already received the tokens of every expert-parallel rank through the all-to-all, so
``1/dp`` is the average over all data-parallel ranks).

Each bucket is padded to a multiple of its group size. With the distributed optimizer the
buckets are *reduce-scattered* instead (``bucket.reduce_scatter = True``): data-parallel rank i
then holds the averaged gradient only in its chunk ``i`` of every bucket, which is the part of
the parameters whose optimizer state it owns. A tied embedding/output weight (``shared_embedding``)
gets a bucket of its own when pipelining, so the first and last stage shard it identically.

Hybrid sharding (``--num-distributed-optimizer-instances N``): dense buckets belong to the
``dp_shard`` group (DP x CP / N ranks) and carry ``replicate_group`` (the N ranks holding the same
shard). A bucket is reduce-scattered inside its shard group, then its shard is all-reduced over the
replicate group, which together sum over all DP x CP ranks. The second collective needs the first's
result, so an overlapped bucket issues it when waited on.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn

from . import comm
from .tensor import all_reduce_sequence_parallel_grads


def default_bucket_size(dp_size: int) -> int:
    """Megatron's default: max(40M, 1M x dp) elements."""
    return max(40_000_000, 1_000_000 * dp_size)


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


class _Bucket:
    """A slice of the grad buffer holding whole parameters, reduced as one tensor.

    ``data`` is padded to a multiple of the group size so it can also be reduce-scattered
    (distributed optimizer): rank i of the group then owns ``data.chunk(size)[i]``.
    ``offsets[id(p)]`` is ``(start, end)`` of each param inside ``data``.
    """

    def __init__(self, params: list[nn.Parameter], data: torch.Tensor, group, scale: float, offsets: dict,
                 replicate_group=None):
        self.params, self.data, self.group, self.scale, self.offsets = params, data, group, scale, offsets
        self.replicate_group = replicate_group  # hybrid sharding: the same shard on the other instances
        self.ids = {id(p) for p in params}
        self.reduce_scatter = False  # set by the distributed optimizer
        self.reset()

    def reset(self) -> None:
        self.ready: set[int] = set()
        self.handle = None
        self.launched = False

    def shard(self) -> tuple[int, int]:
        """``[start, end)`` of ``data`` owned by this rank of the group."""
        n = self.data.numel() // comm.group_size(self.group)
        rank = comm.group_rank(self.group)
        return rank * n, (rank + 1) * n

    def launch(self, async_op: bool) -> None:
        """Average this bucket over its group (divide, then sum; or sum-and-scatter)."""
        self.launched = True
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
        """Hybrid sharding: sum this rank's shard (or the whole bucket) over the replicate group."""
        if comm.group_size(self.replicate_group) == 1:
            return
        start, end = self.shard() if self.reduce_scatter else (0, self.data.numel())
        comm.record("dp", "all_reduce", comm.tensor_bytes(self.data[start:end]), comm.group_size(self.replicate_group))
        dist.all_reduce(self.data[start:end], group=self.replicate_group)

    def wait(self) -> None:
        if self.handle is not None:
            self.handle.wait()
            self.handle = None
            self._reduce_over_replicas()  # an overlapped launch left the second stage for now


class DistributedDataParallel(nn.Module):
    """Wrap ``module`` so its gradients accumulate in an fp32 buffer and are averaged over DP.

    ``forward`` is the module's forward. Call :meth:`zero_grad_buffer` before each iteration's
    first backward, run backward for every micro-batch (all but the last inside :meth:`no_sync`),
    then :meth:`finish_grad_sync` (or :func:`finalize_model_grads` for all chunks).
    """

    def __init__(self, module: nn.Module, state, *, overlap_grad_reduce: bool = False, bucket_size: int | None = None):
        super().__init__()
        self.module = module
        self.state = state
        self.overlap_grad_reduce = overlap_grad_reduce
        self.bucket_size = bucket_size if bucket_size is not None else default_bucket_size(state.dp_size)
        if self.bucket_size < 1:
            raise ValueError(f"ddp-bucket-size must be positive, got {self.bucket_size}")
        self._sync_enabled = True

        params = [p for p in module.parameters() if p.requires_grad]
        if any(hasattr(p, "main_grad") for p in params):
            raise ValueError("DistributedDataParallel: this module is already wrapped (its parameters have "
                             "main_grad); wrap each model chunk once")
        dense = [p for p in reversed(params) if getattr(p, "allreduce", True)]
        expert = [p for p in reversed(params) if not getattr(p, "allreduce", True)]
        self.params = dense + expert
        device = params[0].device if params else torch.device("cpu")

        # Plan the buckets: (params, group), each bucket padded to a multiple of its group size.
        plan = []
        # Dense weights are replicated over data AND context parallel ranks (CP ranks see different
        # tokens of the same samples), so their gradients are averaged over the DP x CP group.
        # With hybrid sharding the dense buckets are sharded over dp_shard only (see the module docstring).
        for group_params, group in ((dense, state.dp_shard_group), (expert, state.expert_dp_group)):
            current, size = [], 0
            for p in group_params:
                if getattr(p, "shared_embedding", False) and state.pp_size > 1:
                    # Alone in its bucket, so the first and last stage shard it identically
                    # (the embedding all-reduce after a reduce-scatter then adds matching pieces).
                    if current:
                        plan.append((current, group))
                    plan.append(([p], group))
                    current, size = [], 0
                    continue
                current.append(p)
                size += p.numel()
                if size >= self.bucket_size:
                    plan.append((current, group))
                    current, size = [], 0
            if current:
                plan.append((current, group))
        padded = [_round_up(sum(p.numel() for p in ps), comm.group_size(g)) for ps, g in plan]
        self.grad_buffer = torch.zeros(sum(padded), dtype=torch.float32, device=device)

        scale = 1.0 / (state.dp_size * state.cp_size)
        self.buckets: list[_Bucket] = []
        start = 0
        for (bucket_params, group), numel in zip(plan, padded):
            data = self.grad_buffer[start : start + numel]
            offsets, offset = {}, 0
            for p in bucket_params:
                p.main_grad = data[offset : offset + p.numel()].view(p.shape)
                offsets[id(p)] = (offset, offset + p.numel())
                offset += p.numel()
            replicate = state.dp_replicate_group if getattr(bucket_params[0], "allreduce", True) else None
            self.buckets.append(_Bucket(bucket_params, data, group, scale, offsets, replicate))
            start += numel
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook()) for p in self.params]

    # ------------------------------------------------------------------------------------------
    def _make_hook(self):
        def hook(param: torch.Tensor) -> None:
            if param.grad is None:
                return
            param.main_grad.add_(param.grad)  # fp32 accumulate, whatever the param dtype
            param.grad = None
            if self._sync_enabled:
                self._mark_ready(param)

        return hook

    def _mark_ready(self, param) -> None:
        bucket = self._bucket_of[id(param)]
        if bucket.launched:
            raise RuntimeError(
                "a gradient arrived for a parameter whose bucket was already reduced this iteration; "
                "run all but the last micro-batch's backward inside no_sync() and call zero_grad_buffer() "
                "before the next iteration"
            )
        bucket.ready.add(id(param))
        if self.overlap_grad_reduce and len(bucket.ready) == len(bucket.ids):
            bucket.launch(async_op=True)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients without reducing them (all but the last micro-batch)."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def finish_grad_sync(self) -> None:
        """Reduce the buckets not yet launched, then wait for every outstanding reduction."""
        for bucket in self.buckets:
            if not bucket.launched:
                bucket.launch(async_op=self.overlap_grad_reduce)
        for bucket in self.buckets:
            bucket.wait()
        for bucket in self.buckets:
            bucket.reset()

    def zero_grad_buffer(self) -> None:
        """Zero every main_grad (one fill of the buffer) and forget this iteration's bucket state."""
        for bucket in self.buckets:
            bucket.wait()
            bucket.reset()
        self.grad_buffer.zero_()
        for p in self.params:
            p.grad = None

    # Checkpoints hold the wrapped module's weights under their plain names.
    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, **kwargs):
        return self.module.load_state_dict(state_dict, strict=strict, **kwargs)


def finalize_model_grads(chunks: list[DistributedDataParallel], state) -> None:
    """Finish every gradient reduction of one iteration before the optimizer step.

    1. Data parallel: :meth:`DistributedDataParallel.finish_grad_sync` on each chunk.
    2. Sequence parallel: replicated parameters marked ``sequence_parallel`` saw only this rank's
       sequence shard, so their ``main_grad`` is summed over the tensor-parallel group.
    3. Pipeline parallel with tied embeddings: the first stage's word embedding and the last
       stage's output layer are the same weight (attribute ``shared_embedding=True``); their
       gradients are summed over the embedding group so both copies take the same step.
    """
    for chunk in chunks:
        chunk.finish_grad_sync()
    params = [p for chunk in chunks for p in chunk.params]
    # all_reduce_sequence_parallel_grads reads ``.grad``: hand it views of main_grad instead.
    views = [SimpleNamespace(sequence_parallel=True, grad=p.main_grad) for p in params if getattr(p, "sequence_parallel", False)]
    all_reduce_sequence_parallel_grads(views, state.tp_group)
    if state.pp_size > 1 and state.in_embedding_group():
        shared = [p for p in params if getattr(p, "shared_embedding", False)]
        if len(shared) > 1:
            raise RuntimeError(f"expected at most one shared embedding weight per rank, found {len(shared)}")
        if shared:
            comm.record("pp", "all_reduce", comm.tensor_bytes(shared[0].main_grad), comm.group_size(state.embedding_group))
            dist.all_reduce(shared[0].main_grad, group=state.embedding_group)
