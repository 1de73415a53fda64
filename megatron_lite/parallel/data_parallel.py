"""Data parallelism: one contiguous fp32 gradient buffer, reduced in buckets during backward.

:class:`DistributedDataParallel` wraps one model chunk. Every trainable parameter gets a
``main_grad`` attribute: an fp32 view into a single flat buffer. A hook on each parameter's
gradient accumulation adds the freshly computed ``param.grad`` (any dtype: bf16/fp16 params too)
into ``main_grad`` in fp32 and frees ``param.grad``, so gradients accumulate over micro-batches in
fp32 without a second copy. A GEMM with gradient-accumulation fusion skips ``param.grad`` altogether:
it calls ``param.accumulate_main_grad(add)`` (set here), which runs ``add(main_grad)`` and the same
bookkeeping as the hook (parallel/grad_accumulation.py).

:meth:`zero_grad_buffer` does not fill the buffer with zeros: it marks every ``main_grad`` as
holding the last iteration's gradient, and the first gradient of a parameter in the new iteration is
*written* over it (the hook copies ``param.grad``, a GEMM with gradient-accumulation fusion writes its
product: ``first(main_grad)``), later ones are added. A parameter that got no gradient by
:meth:`finish_grad_sync` (unused this iteration) is zeroed there, before any reduction reads it. So
``main_grad`` is this iteration's gradient once a parameter's first gradient arrived, and every
``main_grad`` is after :meth:`finish_grad_sync`; the 4 bytes per parameter of a zero-fill and of
re-reading those zeros are not spent every step (Megatron zeroes its buffer).

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
CP too; on a folded expert grid, the ranks of a stage holding the same ETP x EP shard); they live in their own buckets, reduced over that group and also divided by dp x cp (the
expert already received the tokens of every expert-parallel rank through the all-to-all, so
``1/dp`` is the average over all data-parallel ranks).

The parameters live in flat buffers with the same layout (``bucket.param_data``, one per bucket,
in the params' dtype; every parameter is a view into it), so the optimizer can write a whole bucket
of updated parameters with one copy or all-gather. Each bucket is padded to a multiple of its group size. With the distributed optimizer the
buckets are *reduce-scattered* instead (``bucket.reduce_scatter = True``): data-parallel rank i
then holds the averaged gradient only in its chunk ``i`` of every bucket, which is the part of
the parameters whose optimizer state it owns. A tied embedding/output weight (``shared_embedding``)
gets a bucket of its own when pipelining, so the first and last stage shard it identically.

Hybrid sharding (``--num-distributed-optimizer-instances N``): dense buckets belong to the
``dp_shard`` group (DP x CP / N ranks) and carry ``replicate_group`` (the N ranks holding the same
shard). A bucket is reduce-scattered inside its shard group, then its shard is all-reduced over the
replicate group, which together sum over all DP x CP ranks. The second collective needs the first's
result, so an overlapped bucket issues it when waited on. Expert buckets are cut the same way:
``expert_dp_shard`` (expert-DP x CP / N ranks) and ``expert_dp_replicate``. With sharded grads
(ZeRO-2/3, HSDP) each micro-batch's bucket is reduce-scattered inside the instance and added into
the shard; the replicas' all-reduce runs once a step, on the accumulated shard, in
:meth:`finish_grad_sync` (a sum is a sum: the same gradient, with one cross-instance all-reduce per
step instead of one per micro-batch; consecutive buckets of one replicate group go in one call).

Sharding strategies (``strategy``, the ``--data-parallel-sharding-strategy`` names): ``no_shard`` and
``optim`` keep the full buffer above. ``optim_grads`` (ZeRO-2) keeps only this rank's shard of each
bucket (``bucket.grad_shard``, one persistent fp32 tensor for all buckets): a bucket's full-size
buffer is allocated when its first gradient of a backward pass arrives, reduce-scattered once all
its parameters have reported (or at the end of that backward pass), added into the shard and
dropped. Every micro-batch's backward is therefore reduced (``no_sync`` has no effect): the
gradient cannot wait in a full buffer (a zero-bubble W pass is a backward pass of its own, reduced
at its end). ``optim_grads_params`` (ZeRO-3) also shards the parameters
(:mod:`megatron_lite.parallel.fsdp`).
"""

from __future__ import annotations

import contextlib
import weakref
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn

from . import comm
from .dp_hooks import on_backward, wait_for_params_before_use
from .grad_bucket import Bucket, all_reduce_runs, replica_runs
from .tensor import all_reduce_sequence_parallel_grads

SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
SHARDED_GRADS = ("optim_grads", "optim_grads_params")


def default_bucket_size(dp_size: int) -> int:
    """Megatron's default: max(40M, 1M x dp) elements."""
    return max(40_000_000, 1_000_000 * dp_size)


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


class DistributedDataParallel(nn.Module):
    """Wrap ``module`` so its gradients accumulate in an fp32 buffer and are averaged over DP.

    ``forward`` is the module's forward. Call :meth:`zero_grad_buffer` before each iteration's
    first backward, run backward for every micro-batch (all but the last inside :meth:`no_sync`),
    then :meth:`finish_grad_sync` (or :func:`finalize_model_grads` for all chunks). ``deferred``: ids of
    the params a zero-bubble schedule gives their gradients in W passes (their own buckets, see ``_plan``).
    """

    def __init__(self, module: nn.Module, state, *, overlap_grad_reduce: bool = False, bucket_size: int | None = None,
                 strategy: str = "no_shard", overlap_param_gather: bool = False, deferred: frozenset = frozenset()):
        super().__init__()
        if strategy not in SHARDING_STRATEGIES:
            raise ValueError(f"data-parallel sharding strategy {strategy!r}: expected one of {SHARDING_STRATEGIES}")
        self.module = module
        self.state = state
        self.strategy, self.shard_grads = strategy, strategy in SHARDED_GRADS
        self.overlap_grad_reduce = overlap_grad_reduce
        self.overlap_param_gather, self.deferred = overlap_param_gather, deferred
        self.bucket_size = bucket_size if bucket_size is not None else default_bucket_size(state.dp_size)
        if self.bucket_size < 1:
            raise ValueError(f"--ddp-bucket-size (DistributedDataParallel's bucket_size) must be positive, "
                             f"got {self.bucket_size}")
        self._sync_enabled = True
        self._flush_queued = False
        self._stale: set[int] = set()  # ids of params whose main_grad still holds the last iteration's gradient

        params = [p for p in module.parameters() if p.requires_grad]
        if any(hasattr(p, "main_grad") for p in params):
            raise ValueError("DistributedDataParallel: this module is already wrapped (its parameters have "
                             "main_grad); wrap each model chunk once")
        dense = [p for p in reversed(params) if getattr(p, "allreduce", True)]
        expert = [p for p in reversed(params) if not getattr(p, "allreduce", True)]
        self.params = dense + expert
        device = params[0].device if params else torch.device("cpu")
        plan = self._plan(dense, expert)
        self._make_buckets(plan, device)
        if strategy != "optim_grads_params":  # ZeRO-3 (fsdp.py) keeps its own flat, sharded storage
            self._flatten_params()
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook()) for p in self.params]
        for p in self.params:
            p.accumulate_main_grad = self._accumulator(p)
        if overlap_param_gather and strategy in ("optim", "optim_grads"):
            wait_for_params_before_use(self.module, self._bucket_of)

    def _plan(self, dense: list, expert: list) -> list[tuple[list, object]]:
        """The buckets as (params, group), in buffer order. ``deferred`` params (W's gradients) never share a
        bucket with the others (B's): a pass reduce-scatters only buckets it gave gradients to."""
        state, plan = self.state, []
        # Dense weights are replicated over data AND context parallel ranks (CP ranks see different
        # tokens of the same samples), so their gradients are averaged over the DP x CP group.
        # With hybrid sharding the buckets are sharded over one instance only (see the module docstring).
        streams = [([p for p in ps if (id(p) in self.deferred) == later], group) for later in (False, True)
                   for ps, group in ((dense, state.dp_shard_group), (expert, state.expert_dp_shard_group))]
        for group_params, group in streams:
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
        return plan

    def _make_buckets(self, plan, device) -> None:
        """Each bucket padded to a multiple of its group size; one flat fp32 gradient buffer (or, with
        sharded grads, one flat buffer of this rank's shards)."""
        padded = [_round_up(sum(p.numel() for p in ps), comm.group_size(g)) for ps, g in plan]
        shard_sizes = [n // comm.group_size(g) for n, (_, g) in zip(padded, plan)]
        self.grad_buffer = None if self.shard_grads else torch.zeros(sum(padded), dtype=torch.float32, device=device)
        self.grad_shards = torch.zeros(sum(shard_sizes), dtype=torch.float32, device=device) if self.shard_grads else None
        scale = 1.0 / (self.state.dp_size * self.state.cp_size)
        self.buckets: list[Bucket] = []
        start, shard_start = 0, 0
        for (bucket_params, group), numel, shard_size in zip(plan, padded, shard_sizes):
            data = None if self.shard_grads else self.grad_buffer[start : start + numel]
            offsets, offset = {}, 0
            for p in bucket_params:
                p.main_grad = None if data is None else data[offset : offset + p.numel()].view(p.shape)
                offsets[id(p)] = (offset, offset + p.numel())
                offset += p.numel()
            dense = getattr(bucket_params[0], "allreduce", True)
            replicate = self.state.dp_replicate_group if dense else self.state.expert_dp_replicate_group
            bucket = Bucket(bucket_params, data, group, scale, offsets, numel, device, replicate)
            if self.shard_grads:
                bucket.grad_shard = self.grad_shards[shard_start : shard_start + shard_size]
            bucket.defer_replicas = self.shard_grads  # summed over the replicas once a step (finish_grad_sync)
            self.buckets.append(bucket)
            start, shard_start = start + numel, shard_start + shard_size
        self._replica_runs = replica_runs(self.buckets) if self.shard_grads else []

    def _flatten_params(self) -> None:
        """Each single-dtype bucket's params become views of one flat buffer (:meth:`Bucket.flatten_params`)."""
        for bucket in self.buckets:
            bucket.flatten_params()

    def finish_param_gather(self) -> None:
        """Complete every in-flight parameter all-gather (before reading the weights outside forward)."""
        for bucket in self.buckets:
            bucket.finish_param_gather()

    # ------------------------------------------------------------------------------------------
    def _make_hook(self):
        # The hook is kept by the parameter's autograd data, in C++, out of the garbage collector's
        # sight: a strong reference to this wrapper would keep the model, and the process groups its
        # ParallelState holds, alive until interpreter exit (see device.shutdown_distributed).
        wrapper = weakref.ref(self)

        def hook(param: torch.Tensor) -> None:
            self = wrapper()
            if self is None:
                return
            if param.grad is None:  # its gradients of this pass were added already (fusion), or deferred to W
                if self.shard_grads and id(param) in self.deferred and id(param) not in self._bucket_of[id(param)].ready:
                    self._mark_ready(param, always=True)  # B: its bucket need not wait for W's gradient
                return
            grad, param.grad = param.grad, None
            self._accumulate(param, lambda main_grad: main_grad.add_(grad),  # fp32 accumulate, any param dtype
                             first=lambda main_grad: main_grad.copy_(grad))

        return hook

    def _accumulator(self, param):
        """``param.accumulate_main_grad``: gradient-accumulation fusion hands its GEMM here."""
        return lambda add, ready=True, first=None: self._accumulate(param, add, ready, first)

    def _accumulate(self, param, add, ready: bool = True, first=None) -> None:
        """``add(main_grad)`` adds this backward's gradient of ``param`` (``first(main_grad)`` writes it,
        for the iteration's first gradient of ``param``: module docstring), then (``ready``: no other
        gradient of it follows in this backward) the bucket bookkeeping. Sharded grads: into the
        bucket's per-backward buffer, reduced once every param reported."""
        if self.shard_grads:
            self._queue_flush()  # a backward that did not start at this chunk's output: a zero-bubble W pass
            bucket = self._bucket_of[id(param)]
            if bucket.data is None:
                bucket.allocate()
            add(param.main_grad)
            if ready:
                self._mark_ready(param, always=True)
            return
        if self._stale and id(param) in self._stale:
            self._stale.discard(id(param))
            if first is not None:
                first(param.main_grad)
            else:
                add(param.main_grad.zero_())
        else:
            add(param.main_grad)
        if ready and self._sync_enabled:
            self._mark_ready(param)

    def _mark_ready(self, param, always: bool = False) -> None:
        bucket = self._bucket_of[id(param)]
        if bucket.launched:
            raise RuntimeError(
                "a gradient arrived for a parameter whose bucket was already reduced this iteration; "
                "run all but the last micro-batch's backward inside no_sync() and call zero_grad_buffer() "
                "before the next iteration"
            )
        bucket.ready.add(id(param))
        if len(bucket.ready) == len(bucket.ids) and (always or self.overlap_grad_reduce):
            bucket.launch(async_op=self.overlap_grad_reduce)
            if self.shard_grads and not self.overlap_grad_reduce:
                bucket.keep_shard()
            if self.shard_grads:
                self._bucket_reduced(bucket)

    def _bucket_reduced(self, bucket) -> None:
        """Called once a bucket's reduction is launched in a backward pass (sharded grads); fsdp.py frees
        the unit's gathered parameters here."""

    def _before_backward(self) -> None:
        """Sharded grads: at the start of a backward pass through this chunk, schedule :meth:`_flush`
        for its end (reduces buckets some of whose params got no gradient; drops the full buffers)."""
        self._queue_flush()

    def _queue_flush(self) -> None:
        """Have the backward pass running now call :meth:`_flush` at its end (once)."""
        if not self._flush_queued and torch._C._current_graph_task_id() != -1:
            self._flush_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._flush)

    def _flush(self) -> None:
        self._flush_queued = False
        for bucket in self.buckets:
            if bucket.data is not None and not bucket.launched:
                bucket.launch(async_op=self.overlap_grad_reduce)
                self._bucket_reduced(bucket)
        for bucket in self.buckets:
            if bucket.data is not None:
                bucket.keep_shard()
            bucket.reset()

    def forward(self, *args, **kwargs):
        out = self.module(*args, **kwargs)
        if self.shard_grads and torch.is_grad_enabled():
            on_backward(out, self._before_backward)
        return out

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
        if self.shard_grads:  # reduce-scattered at the end of every backward pass already
            self._flush()
            all_reduce_runs(self.grad_shards, self._replica_runs)  # hybrid sharding: once a step
            return
        self._zero_stale()
        for bucket in self.buckets:
            if not bucket.launched:
                bucket.launch(async_op=self.overlap_grad_reduce)
        for bucket in self.buckets:
            bucket.wait()
        for bucket in self.buckets:
            bucket.reset()

    def zero_grad_buffer(self) -> None:
        """Start an iteration: every main_grad is written over by its first gradient (module docstring),
        and this iteration's bucket state is forgotten."""
        for bucket in self.buckets:
            bucket.wait()
            bucket.reset()
            if self.shard_grads and bucket.data is not None:
                bucket.data = None
                for p in bucket.params:
                    p.main_grad = None
        if self.shard_grads:
            self.grad_shards.zero_()
        else:  # written over by each param's first gradient (module docstring)
            self._stale = {id(p) for p in self.params}
        for p in self.params:
            p.grad = None

    def _zero_stale(self) -> None:
        """Zero the ``main_grad`` of every param that got no gradient since :meth:`zero_grad_buffer`."""
        for p in self.params:
            if id(p) in self._stale:
                p.main_grad.zero_()
        self._stale.clear()

    def owned_grad(self, param) -> torch.Tensor:
        """The part of ``param``'s gradient this rank holds, flat: all of ``main_grad``, or (sharded
        grads) the overlap of the param with this rank's chunk of its bucket (possibly empty)."""
        if not self.shard_grads:
            return param.main_grad.view(-1)
        bucket = self._bucket_of[id(param)]
        a, e = bucket.offsets[id(param)]
        start, end = bucket.shard()
        lo, hi = max(a, start), min(e, end)
        return bucket.grad_shard[lo - start : hi - start] if lo < hi else bucket.grad_shard[:0]

    # Checkpoints hold the wrapped module's weights under their plain names.
    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, **kwargs):
        return self.module.load_state_dict(state_dict, strict=strict, **kwargs)


def finalize_model_grads(chunks: list[DistributedDataParallel], state) -> None:
    """Finish every gradient reduction of one iteration before the optimizer step.

    1. Data parallel: :meth:`DistributedDataParallel.finish_grad_sync` on each chunk.
    2. Sequence parallel: replicated parameters marked ``sequence_parallel`` saw only this rank's
       sequence shard, so their ``main_grad`` is summed over the tensor-parallel group (``sum_over_etp``:
       over a folded expert grid's expert-tensor group).
    3. Pipeline parallel with tied embeddings: the first stage's word embedding and the last
       stage's output layer are the same weight (attribute ``shared_embedding=True``); their
       gradients are summed over the embedding group so both copies take the same step.
    """
    for chunk in chunks:
        chunk.finish_grad_sync()
    # all_reduce_sequence_parallel_grads reads ``.grad``: hand it the gradient this rank holds instead
    # (the whole main_grad, or with sharded grads its slice: the same slice on every TP rank).
    held = [(p, chunk.owned_grad(p)) for chunk in chunks for p in chunk.params]
    views = [SimpleNamespace(sequence_parallel=True, grad=g) for p, g in held if getattr(p, "sequence_parallel", False)]
    all_reduce_sequence_parallel_grads(views, state.tp_group)
    # folded expert grid: fc2's bias, whole on each expert-tensor rank, is summed over the ETP group
    etp_views = [SimpleNamespace(sequence_parallel=True, grad=g) for p, g in held if getattr(p, "sum_over_etp", False)]
    all_reduce_sequence_parallel_grads(etp_views, getattr(state, "etp_group", None))
    if state.pp_size > 1 and state.in_embedding_group():
        shared = [g for p, g in held if getattr(p, "shared_embedding", False)]
        if len(shared) > 1:
            raise RuntimeError(f"expected at most one shared embedding weight per rank, found {len(shared)}")
        if shared:
            comm.record("pp", "all_reduce", comm.tensor_bytes(shared[0]), comm.group_size(state.embedding_group))
            dist.all_reduce(shared[0], group=state.embedding_group)
