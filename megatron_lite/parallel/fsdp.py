"""ZeRO-3 (``--data-parallel-sharding-strategy optim_grads_params``): parameters sharded per unit.

A *unit* is a module marked ``sharding_unit = True`` (a transformer layer, the embedding, the
output layer) holding parameters; what no unit holds (final norm, and a tied word embedding that
the output layer of the same chunk reads) forms the chunk's *root* unit. Each unit's parameters
form one or more buckets of :class:`~megatron_lite.parallel.data_parallel.DistributedDataParallel`
(dense, expert, and a pipelined tied embedding alone; the root: one per parameter), each flattened into one padded buffer
``full`` of the params dtype. Every parameter is a view of its bucket's ``full`` for the whole
run, so the layers keep reading ``weight`` as a plain tensor; between uses the storage of ``full``
is resized to zero bytes, and only ``bucket.param_shard``, this rank's chunk, stays. A freed
parameter must not be read (a layer's read raises, but an element-wise read of memory that is gone
crashes inside PyTorch): read the values inside :func:`full_params`. The parameters are
:class:`ShardedParameter`, so printing one (or the model) never reads freed memory.
Per forward and per backward:

* forward: a pre-hook all-gathers the unit (and, with ``--overlap-param-gather``, starts the next
  unit's all-gather); a hook frees it after its forward and hooks the unit's outputs;
* backward: the hook on the outputs gathers the unit again before its backward (and prefetches
  the previous unit); once every parameter of a bucket has accumulated its gradient the bucket is
  reduce-scattered into the sharded gradient (``optim_grads``' machinery), and once all the unit's
  buckets are, the unit is freed. At the end of the backward pass any unit still gathered is freed.
* full recompute reruns a unit's forward inside backward: then it is gathered and stays gathered
  until its backward is done.
* FP8: the gemms read the gathered full weight, so their weight amaxes are the whole weight's; a
  unit's free also drops the quantised weights its FP8 gemms cache between micro-batches.

The optimizer steps its fp32 master shard and writes the result into ``param_shard``: no
parameter all-gather after the step. Checkpoints hold full tensors (:func:`full_params`).
"""

from __future__ import annotations

import contextlib

import torch

from . import comm
from .data_parallel import DistributedDataParallel
from .dp_hooks import on_backward
from .pipeline.wgrad import deferred_params


class ShardedParameter(torch.nn.Parameter):
    """A ZeRO-3 parameter: a view of its bucket's ``full`` buffer, whose storage is gone between uses.

    Only ``repr`` differs from ``nn.Parameter``: PyTorch's printer would read the freed memory (and
    crash the process); this one prints the shape and dtype, and the values only while gathered.
    """

    def __repr__(self) -> str:
        if is_gathered(self):
            return f"Parameter containing:\n{self.detach()!r}"
        return (f"ShardedParameter(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device}: "
                "sharded by ZeRO-3 and not gathered now; read it inside full_params(chunks))")


def is_gathered(tensor: torch.Tensor) -> bool:
    """Whether the storage behind ``tensor`` holds all its elements (False for a freed ZeRO-3 view)."""
    if tensor.numel() == 0:
        return True
    last = tensor.storage_offset() + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()))
    return tensor.untyped_storage().nbytes() >= (last + 1) * tensor.element_size()


def _in_backward() -> bool:
    """True while the autograd engine runs a backward pass (a recomputation inside backward)."""
    return torch._C._current_graph_task_id() != -1


class _Unit:
    """The buckets of one unit and whether their parameters are gathered."""

    def __init__(self, name: str, buckets: list):
        self.name, self.buckets = name, buckets
        self.gathered = False
        self.pending: list = []
        self.enabled = True  # tests switch a unit's gather off to prove every read is guarded
        self.weight_caches: list = []  # modules with drop_weight_cache() (FP8 gemms) reading this unit's weights

    def start_gather(self) -> None:
        """Launch the all-gathers (asynchronous); :meth:`ensure_gathered` waits for them."""
        if self.gathered or self.pending or not self.enabled:
            return
        for b in self.buckets:
            b.full.untyped_storage().resize_(b.numel * b.full.element_size())
            if comm.group_size(b.group) == 1:
                b.full.copy_(b.param_shard)
                continue
            comm.record("dp", "all_gather", comm.tensor_bytes(b.full), comm.group_size(b.group))
            self.pending.append(comm.all_gather_single(b.full, b.param_shard, group=b.group, async_op=True))

    def ensure_gathered(self) -> None:
        if self.gathered or not self.enabled:
            return
        self.start_gather()
        for handle in self.pending:
            handle.wait()
        self.pending = []
        self.gathered = True

    def free(self) -> None:
        if self.pending:  # a prefetch nobody used: finish it before dropping its buffer
            self.ensure_gathered()
        for b in self.buckets:
            b.full.untyped_storage().resize_(0)
        for m in self.weight_caches:  # a copy of the weights (FP8) must not outlive the gathered ones
            m.drop_weight_cache()
        self.gathered = False


def _unit_modules(module) -> list[tuple[str, torch.nn.Module]]:
    """The marked modules that become units, outermost first; one holding a tied word embedding stays
    in the root (the output layer of the same chunk reads that weight outside the unit's forward)."""
    units, taken = [], set()
    for name, m in module.named_modules():
        if not getattr(m, "sharding_unit", False) or any(name.startswith(t + ".") for t in taken):
            continue
        params = list(m.parameters())
        if not params or any(getattr(p, "shared_embedding", False) for p in params):
            continue
        units.append((name, m))
        taken.add(name)
    return units


def _assign_weight_caches(module, units: list[_Unit]) -> None:
    """Give each unit the modules inside it that keep a copy of a weight between calls (an FP8 gemm
    caches its quantised weight for the step's other micro-batches): freeing the unit drops them, so
    between uses a unit holds its shard only, as without FP8. What no unit holds goes to the root."""
    inside = set()
    for unit in units[:-1]:
        if unit.module is not None:
            unit.weight_caches = [m for m in unit.module.modules() if hasattr(m, "drop_weight_cache")]
            inside.update(id(m) for m in unit.weight_caches)
    units[-1].weight_caches = [m for m in module.modules() if hasattr(m, "drop_weight_cache") and id(m) not in inside]


class FullyShardedDataParallel(DistributedDataParallel):
    """:class:`DistributedDataParallel` with ``strategy="optim_grads_params"``: see the module docstring."""

    def __init__(self, module, state, **kwargs):
        kwargs["strategy"] = "optim_grads_params"
        super().__init__(module, state, **kwargs)
        self._shard_params()
        for i, unit in enumerate(self.units):
            if unit.module is not None:
                unit.module.register_forward_pre_hook(self._pre_forward(i))
                unit.module.register_forward_hook(self._post_forward(i))

    def _plan(self, dense, expert):
        """One bucket group per unit (bucket_size does not split a unit), the root last, one bucket per
        root parameter: the root's parameters get their gradients at different times of backward (the
        final norm's first, a tied word embedding's last), and a bucket's full fp32 gradient buffer
        lives from its first gradient to its reduce-scatter, so one root bucket would keep an
        embedding-sized buffer alive through the whole backward pass."""
        ids = {id(p) for p in dense + expert}
        self._unit_params = []
        claimed = set()
        for name, m in _unit_modules(self.module):
            ps = [p for p in m.parameters() if id(p) in ids and id(p) not in claimed]
            claimed.update(id(p) for p in ps)
            self._unit_params.append((name, m, ps))
        root = [p for p in self.module.parameters() if id(p) in ids and id(p) not in claimed]
        self._unit_params.append(("root", None, root))
        plan, self._unit_of_bucket = [], []
        for i, (_, _, ps) in enumerate(self._unit_params):
            keep = {id(p) for p in ps}
            root_unit = i == len(self._unit_params) - 1
            saved, self.bucket_size = self.bucket_size, 1 if root_unit else float("inf")
            unit_plan = super()._plan([p for p in dense if id(p) in keep], [p for p in expert if id(p) in keep])
            self.bucket_size = saved
            plan += unit_plan
            self._unit_of_bucket += [i] * len(unit_plan)
        return plan

    @torch.no_grad()
    def _shard_params(self) -> None:
        """Flatten each bucket's params into ``full``, keep this rank's chunk, make the params views."""
        by_unit: list[list] = [[] for _ in self._unit_params]
        for bucket, i in zip(self.buckets, self._unit_of_bucket):
            dtypes = {p.dtype for p in bucket.params}
            if len(dtypes) > 1:
                raise ValueError(f"optim_grads_params needs one parameter dtype per unit, got {dtypes}")
            bucket.full = torch.zeros(bucket.numel, dtype=bucket.params[0].dtype, device=bucket.device)
            for p in bucket.params:
                a, e = bucket.offsets[id(p)]
                bucket.full[a:e].copy_(p.detach().reshape(-1))
                p.data = bucket.full[a:e].view(p.shape)
                p.__class__ = ShardedParameter
            start, end = bucket.shard()
            bucket.param_shard = bucket.full[start:end].clone()
            bucket.full.untyped_storage().resize_(0)
            by_unit[i].append(bucket)
        self.units = [_Unit(name, bs) for (name, _, _), bs in zip(self._unit_params, by_unit)]
        for unit, (_, m, _) in zip(self.units, self._unit_params):
            unit.module = m
        self.root = self.units[-1]
        _assign_weight_caches(self.module, self.units)
        self.layer_units = [u for u in self.units[:-1] if u.buckets]
        self._unit_index = {id(b): i for i, u in enumerate(self.units) for b in u.buckets}

    # hooks ------------------------------------------------------------------------------------
    def _neighbour(self, i: int, step: int):
        """The unit run after (step 1, forward) or before (step -1, backward) unit ``i``, if any."""
        j = i + step
        return self.units[j] if 0 <= j < len(self.units) - 1 else None

    def _pre_forward(self, i: int):
        def hook(module, args):
            self.units[i].ensure_gathered()
            nxt = self._neighbour(i, 1)
            if self.overlap_param_gather and nxt is not None and not _in_backward():
                nxt.start_gather()

        return hook

    def _post_forward(self, i: int):
        def hook(module, args, output):
            if _in_backward():  # recomputation: its backward follows at once, keep the params
                return output
            self.units[i].free()
            if torch.is_grad_enabled():
                on_backward(output, lambda: self._gather_for_backward(i))
            return output

        return hook

    def _gather_for_backward(self, i: int) -> None:
        self.units[i].ensure_gathered()
        prev = self._neighbour(i, -1)
        if self.overlap_param_gather and prev is not None:
            prev.start_gather()

    def forward(self, *args, **kwargs):
        self.root.ensure_gathered()
        if self.overlap_param_gather and self.layer_units:
            self.units[0].start_gather()
        out = self.module(*args, **kwargs)
        self.root.free()
        if torch.is_grad_enabled():
            on_backward(out, self._before_backward)
        return out

    def _before_backward(self) -> None:
        super()._before_backward()
        self.root.ensure_gathered()
        last = len(self.units) - 2
        if self.overlap_param_gather and last >= 0:
            self.units[last].start_gather()

    def _bucket_reduced(self, bucket) -> None:
        unit = self.units[self._unit_index[id(bucket)]]
        if all(b.launched for b in unit.buckets):
            unit.free()

    def _flush(self) -> None:
        super()._flush()
        for unit in self.units:
            if unit.gathered or unit.pending:
                unit.free()

    # whole parameters ---------------------------------------------------------------------------
    @torch.no_grad()
    def gather_all(self, communicate: bool = True) -> None:
        """Every parameter holds full values in a storage of its own (``communicate=False``: storage
        only, to be overwritten by a load). Own storages, because readers such as a checkpoint
        writer may pin them (e.g. through numpy) and ``full`` must stay resizable."""
        for unit in self.units:
            if communicate:
                unit.ensure_gathered()
            for b in unit.buckets:
                for p in b.params:
                    p.data = p.data.clone() if communicate else torch.empty_like(p.data, memory_format=torch.contiguous_format)
            if communicate:
                unit.free()

    @torch.no_grad()
    def reshard_all(self, keep_values: bool) -> None:
        """The params become views of ``full`` again; ``keep_values`` first keeps this rank's chunk of
        their current values in the shard."""
        for unit in self.units:
            for b in unit.buckets:
                start, end = b.shard()
                b.full.untyped_storage().resize_(b.numel * b.full.element_size())  # views need the size
                for p in b.params:
                    a, e = b.offsets[id(p)]
                    if keep_values and min(e, end) > max(a, start):
                        lo, hi = max(a, start), min(e, end)
                        b.param_shard[lo - start : hi - start].copy_(p.detach().reshape(-1)[lo - a : hi - a])
                    p.data = b.full[a:e].view(p.shape)
            unit.free()


@contextlib.contextmanager
def full_params(chunks, load: bool = False, partial: bool = False):
    """Inside: every chunk's parameters hold full values (e.g. to save or load a checkpoint).

    ZeRO-3 chunks are all-gathered (collective over data parallel; with ``load`` only the storage is
    made, no communication, and this rank's chunk is kept from what was loaded on exit; with
    ``partial`` too a load that may leave some parameters as they are: gathered first, then kept);
    in-flight ``--overlap-param-gather`` all-gathers are completed.
    """
    sharded = [c for c in chunks if isinstance(c, FullyShardedDataParallel)]
    for c in chunks:
        if isinstance(c, DistributedDataParallel):
            c.finish_param_gather()
    for c in sharded:
        c.gather_all(communicate=partial or not load)
    ok = False
    try:
        yield
        ok = True
    finally:
        for c in sharded:
            c.reshard_all(keep_values=(load or partial) and ok)


def wrap_for_data_parallel(module, state, parallel) -> DistributedDataParallel:
    """The data-parallel wrapper of one model chunk for the ``parallel`` flags (ParallelConfig)."""
    kwargs = dict(overlap_grad_reduce=parallel.overlap_grad_reduce, bucket_size=parallel.ddp_bucket_size,
                  overlap_param_gather=parallel.overlap_param_gather)
    strategy = parallel.data_parallel_sharding_strategy
    if strategy in ("optim_grads", "optim_grads_params") and parallel.pipeline_schedule == "zb-h1" and state.pp_size > 1:
        kwargs["deferred"] = deferred_params(module)  # reduce-scattered by the W passes, in buckets of their own
    if strategy == "optim_grads_params":
        return FullyShardedDataParallel(module, state, **kwargs)
    return DistributedDataParallel(module, state, strategy=strategy, **kwargs)
