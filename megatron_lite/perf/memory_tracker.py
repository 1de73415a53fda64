"""Live tensor memory by category, on any device: what ``--memory-report`` prints.

:class:`MemoryTracker` is a ``TorchDispatchMode``: it sees every tensor an operator returns and
keeps, per storage (views share one), its bytes, device and category, until the storage is freed
(a weak reference tells) or resized (``UntypedStorage.resize_``, which ZeRO-3 uses to free gathered
parameters, is wrapped while tracking). Live and peak bytes are kept per device, so the peak is
the highest sum of live tensor bytes, whatever the allocator or the process keeps besides (on a
CPU the resident set also holds freed heap, the Python interpreter and gloo's buffers).

Categories, in the order a storage's label is decided:

* model state, by what holds it (:func:`~megatron_lite.perf.model_state.model_state_tensors`,
  re-read at every new peak): ``parameters`` (weights; ZeRO-3: this rank's shards),
  ``gradients`` (the fp32 grad buffer or shards, a ``param.grad`` not yet accumulated),
  ``optimizer state`` (fp32 masters, Adam moments and step counts, on host or device);
* ``communication``: the data-parallel wrappers' transient buffers (ZeRO-3's gathered units,
  ZeRO-2/3's full-size gradient buckets awaiting their reduce-scatter, an all-gather of updated
  parameters in flight) and any other tensor a collective (``c10d``) reads or writes;
* ``activations``: tensors autograd keeps for backward (a ``saved_tensors_hooks`` pair sees each
  saved reference made and dropped), for as long as some graph keeps them;
* ``temporaries``: everything else (intermediate results, gradients flowing through backward,
  the optimizer's scratch).

A storage moves up the list when it is found to be more (a temporary that a collective fills is
communication; one saved for backward is an activation until the graph drops it). Tensors made before tracking
started count once an operator returns or saves them, or they belong to the model state; module
buffers (FP8 scales, rotary tables) are not counted.
"""

from __future__ import annotations

import contextlib
import gc
import time
import weakref
from dataclasses import dataclass, field

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .model_state import model_state_tensors

MODEL_STATE = ("parameters", "gradients", "optimizer state")
CATEGORIES = MODEL_STATE + ("activations", "communication", "temporaries")
_RANK = {"temporaries": 0, "communication": 1, "activations": 2}  # model state outranks all three


@dataclass
class Snapshot:
    """Live bytes per category on one device, and where the tracker was when it was taken."""

    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    where: str = ""

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    def format(self, unit: int = 2**20, name: str = "MiB") -> str:
        parts = " + ".join(f"{k} {v / unit:.2f}" for k, v in self.bytes.items())
        return f"{self.total / unit:.2f} {name} = {parts}" + (f" (at {self.where})" if self.where else "")


class _Entry:
    __slots__ = ("nbytes", "category", "device", "ref", "saved", "before")


class _Saved:
    """What autograd keeps for a saved tensor while tracking: the tensor, and a note to the tracker
    when the graph lets go of it (its last reference then stops being an activation)."""

    __slots__ = ("tensor", "key", "tracker")

    def __init__(self, tensor, key, tracker):
        self.tensor, self.key, self.tracker = tensor, key, tracker

    def __del__(self):
        self.tracker._released(self.key)


class MemoryTracker(TorchDispatchMode):
    """Track live tensor bytes by category (module docstring) while entered.

    ``chunks`` and ``optimizer``: the data-parallel wrapped model chunks and the Megatron optimizer
    whose state is labelled as model state (both optional). :meth:`register` labels other tensors.
    ``current`` and ``peak`` map each device to a :class:`Snapshot`; :meth:`reset_peak` restarts
    the peaks from the current bytes.
    """

    def __init__(self, chunks=(), optimizer=None):
        super().__init__()
        self.chunks, self.optimizer = list(chunks), optimizer
        self._entries: dict[int, _Entry] = {}
        self._pinned: dict[int, str] = {}
        self.current: dict[torch.device, Snapshot] = {}
        self.peak: dict[torch.device, Snapshot] = {}
        self._where = "start"
        self._in_optimizer = 0  # depth of optimizer steps being run
        self._stepped = False  # an optimizer step has ended since tracking began (what follows is after it)
        self._stack: contextlib.ExitStack | None = None

    # labels -------------------------------------------------------------------------------------
    def register(self, tensors, category: str) -> None:
        """Label the storages of ``tensors`` with ``category`` for as long as they live."""
        if category not in CATEGORIES:
            raise ValueError(f"unknown memory category {category!r}; one of {', '.join(CATEGORIES)}")
        for t in tensors:
            self._pin(t, category)

    def _pin(self, t: torch.Tensor, category: str) -> None:
        key = self._track(t, category)
        if key is not None:
            self._pinned[key] = category
            self._set(key, category)

    def _structural_labels(self) -> list[tuple[list, str]]:
        if self.optimizer is None:
            parts = {"params": [p for c in self.chunks for p in c.parameters()], "grads": [], "optimizer": [],
                     "optimizer_cpu": []}
        else:
            parts = model_state_tensors(self.chunks, self.optimizer)
        buckets = [b for c in self.chunks for b in getattr(c, "buckets", [])]
        comm = [b.full for b in buckets if getattr(b, "full", None) is not None]  # ZeRO-3 gathered units
        comm += [b.data for b in buckets if b.grad_shard is not None and b.data is not None]  # full buckets (ZeRO-2/3)
        comm += [b.param_gather[1] for b in buckets if b.param_gather is not None]  # updated params in flight
        grads = [p.grad for c in self.chunks for p in c.parameters() if p.grad is not None]
        return [(parts["params"], "parameters"), (parts["grads"] + grads, "gradients"),
                (parts["optimizer"] + parts["optimizer_cpu"] + self._step_counters(), "optimizer state"),
                (comm, "communication")]

    def _step_counters(self) -> list[torch.Tensor]:
        """The optimizer's 0-dim state (Adam's step counts), which the model-state formula leaves out."""
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        state = getattr(inner, "state", {})
        return [v for entry in state.values() for v in entry.values() if torch.is_tensor(v) and v.dim() == 0]

    def refresh(self) -> None:
        """Re-read which storages hold model state (and the wrappers' buffers); later lists win."""
        for tensors, category in self._structural_labels():
            for t in tensors:
                self._pin(t, category)

    def _promote(self, t: torch.Tensor, category: str) -> None:
        key = self._track(t, category)
        if key is None or key in self._pinned:
            return
        entry = self._entries[key]
        if entry.category == "activations":  # what it returns to once no graph keeps it
            entry.before = max(entry.before, category, key=_RANK.get)
        elif _RANK[category] > _RANK[entry.category]:
            self._set(key, category)

    # bookkeeping --------------------------------------------------------------------------------
    def _snapshot(self, device) -> Snapshot:
        if device not in self.current:
            self.current[device] = Snapshot()
            self.peak[device] = Snapshot()
        return self.current[device]

    def _track(self, t: torch.Tensor, category: str) -> int | None:
        """The key of ``t``'s storage, tracked from now on (under ``category`` if it was not yet); None
        for a tensor without one (sparse, meta, a wrapper subclass)."""
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            return None
        key = id(storage)
        if key in self._entries:
            return key
        entry = _Entry()
        entry.nbytes, entry.category, entry.device = storage.nbytes(), category, storage.device
        entry.saved, entry.before = 0, category
        entry.ref = weakref.ref(storage, lambda _, k=key: self._forget(k))
        self._entries[key] = entry
        self._snapshot(entry.device).bytes[category] += entry.nbytes
        return key

    def _set(self, key: int, category: str) -> None:
        entry = self._entries[key]
        snap = self._snapshot(entry.device)
        snap.bytes[entry.category] -= entry.nbytes
        snap.bytes[category] += entry.nbytes
        entry.category = category

    def _forget(self, key: int) -> None:
        entry = self._entries.pop(key, None)
        self._pinned.pop(key, None)
        if entry is not None:
            self._snapshot(entry.device).bytes[entry.category] -= entry.nbytes

    def _resized(self, storage) -> None:
        entry = self._entries.get(id(storage))
        if entry is not None and entry.nbytes != storage.nbytes():
            self._snapshot(entry.device).bytes[entry.category] += storage.nbytes() - entry.nbytes
            entry.nbytes = storage.nbytes()
            self._check_peak()

    def _check_peak(self) -> None:
        if not any(snap.total > self.peak[dev].total for dev, snap in self.current.items()):
            return
        self.refresh()  # labels as of this moment (model state may have been made since)
        for dev, snap in self.current.items():
            if snap.total > self.peak[dev].total:
                self.peak[dev] = Snapshot(dict(snap.bytes), self._where)

    def reset_peak(self) -> None:
        self.refresh()
        self.peak = {dev: Snapshot(dict(snap.bytes), self._where) for dev, snap in self.current.items()}

    def live(self) -> dict[torch.device, Snapshot]:
        """The current bytes per device, with up-to-date model-state labels."""
        self.refresh()
        return {dev: Snapshot(dict(snap.bytes)) for dev, snap in self.current.items()}

    def settle(self, timeout: float = 1.0) -> None:
        """Wait (at most ``timeout`` seconds) until no collective's buffer is live besides the
        wrappers' own (ZeRO-3 units, buckets and parameter gathers in flight).

        A process group's worker thread may still hold a finished collective's tensors for a moment
        after ``wait()`` returns (gloo lets go within milliseconds), so a scalar the step all-reduced
        can look live just after it. Call this before reading what a step left behind.
        """
        self.refresh()
        deadline = time.monotonic() + timeout
        while self._stray_collective_buffers() and time.monotonic() < deadline:
            time.sleep(0.001)

    def _stray_collective_buffers(self) -> bool:
        return any(e.category == "communication" and k not in self._pinned for k, e in list(self._entries.items()))

    # hooks --------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "c10d":  # the buffers a collective reads or fills
            for t in tree_flatten((args, kwargs))[0]:
                if isinstance(t, torch.Tensor):
                    self._promote(t, "communication")
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t, "temporaries")
        self._where = f"{func} {self._phase()}"
        self._check_peak()
        return out

    def _phase(self) -> str:
        if self._in_optimizer:
            return "in the optimizer step"
        if torch._C._current_graph_task_id() != -1:
            return "in backward"
        return "after the optimizer step" if self._stepped else "in forward"

    def _optimizer_step(self, entering: bool):
        def hook(*_):
            self._in_optimizer += 1 if entering else -1
            self._stepped = self._stepped or not self._in_optimizer

        return hook

    def _wrap_optimizer_step(self) -> None:
        """Count the whole ``self.optimizer.step`` as the optimizer step: a wrapper's work around its torch
        optimizer's step (gradient clipping, the distributed optimizer's parameter all-gather) too."""
        optimizer = self.optimizer
        if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
            return  # a torch optimizer's step is seen by the global step hooks
        step, own = optimizer.step, "step" in vars(optimizer)

        def tracked_step(*args, **kwargs):
            self._in_optimizer += 1
            try:
                return step(*args, **kwargs)
            finally:
                self._in_optimizer -= 1
                self._stepped = self._stepped or not self._in_optimizer

        optimizer.step = tracked_step
        if own:
            self._stack.callback(setattr, optimizer, "step", step)
        else:
            self._stack.callback(delattr, optimizer, "step")

    def _pack(self, t: torch.Tensor):
        key = self._track(t, "temporaries")
        if key is None or key in self._pinned:
            return t
        entry = self._entries[key]
        if entry.saved == 0:
            entry.before = entry.category
            self._set(key, "activations")
        entry.saved += 1
        return _Saved(t, key, self)

    def _released(self, key: int) -> None:
        """An autograd graph dropped a saved reference; the last one turns the storage back into what it was."""
        entry = self._entries.get(key)
        if entry is None:
            return
        entry.saved -= 1
        if entry.saved == 0 and entry.category == "activations" and key not in self._pinned:
            self._set(key, entry.before)

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def __enter__(self):
        self._stack = contextlib.ExitStack()
        original = torch.UntypedStorage.resize_
        tracker = self

        def resize_(storage, size):
            result = original(storage, size)
            tracker._resized(storage)
            return result

        torch.UntypedStorage.resize_ = resize_
        self._stack.callback(setattr, torch.UntypedStorage, "resize_", original)
        self._stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack))
        for register, entering in ((register_optimizer_step_pre_hook, True), (register_optimizer_step_post_hook, False)):
            self._stack.callback(register(self._optimizer_step(entering)).remove)
        self._wrap_optimizer_step()
        self._stepped = False
        self.refresh()
        self._check_peak()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._stack.close()


class MemoryReport:
    """``--memory-report``: a :class:`MemoryTracker` over the first ``steps`` training steps of a run.

    ``tracking()`` wraps one step (a no-op after ``steps`` steps); ``after_step(iteration)`` returns
    the log lines of a tracked step (collective over the default group when distributed: every
    rank calls it): rank 0's peak during the step and its live bytes after it, per device, and the
    rank with the highest peak if that is another one. ``steps_seen`` keeps this rank's records.
    """

    def __init__(self, chunks, optimizer, steps: int = 2):
        self.tracker = MemoryTracker(chunks, optimizer)
        self.steps = steps
        self.steps_seen: list[dict[str, dict]] = []  # per step: {"peak"|"after": {device: Snapshot}}
        self._tracked = False

    def tracking(self):
        self._tracked = len(self.steps_seen) < self.steps
        if not self._tracked:
            return contextlib.nullcontext()
        self.tracker.reset_peak()
        return self.tracker

    def after_step(self, iteration: int) -> list[str]:
        if not self._tracked:
            return []
        self._tracked = False
        gc.collect()  # what only a reference cycle keeps is not counted as left over
        self.tracker.settle()
        record = {"peak": dict(self.tracker.peak), "after": self.tracker.live()}
        self.steps_seen.append(record)
        ranks = [(0, record)]
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            gathered = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(gathered, record)
            ranks = list(enumerate(gathered))
        lines = [_format(iteration, 0, ranks[0][1])]
        top, top_record = max(ranks, key=lambda r: max((s.total for s in r[1]["peak"].values()), default=0))
        if top != 0:
            lines.append(_format(iteration, top, top_record, "highest peak: "))
        return lines


def _format(iteration: int, rank: int, record, prefix: str = "") -> str:
    parts = [f"{dev}: peak {record['peak'][dev].format()}; after the step {snap.format()}"
             for dev, snap in record["after"].items()]
    return f"memory report ({prefix}rank {rank}, iteration {iteration}, live tensor bytes) " + " | ".join(parts)
