"""Optimizer CPU offload (``--optimizer-cpu-offload``): part of the distributed optimizer on the host.

The distributed optimizer steps flat fp32 *pieces* of the parameters this rank owns. With offload
the first ``--optimizer-offload-fraction`` of those elements (in piece order; one piece may be cut
in two so the fraction is met to the element) keep their fp32 master **and** their optimizer state
(Adam's two moments) in host memory, and a second torch optimizer steps them there. The device
keeps what it always keeps (the params and the fp32 gradient buffer) plus the rest of the shard.

Per step, for the host part: the averaged (and unscaled, clipped) gradient is copied device to
host into one flat fp32 buffer, the host optimizer steps, and each updated master is copied host
to device straight into its slice of the model param (in the param dtype); the distributed
optimizer's all-gather then reads that slice (ZeRO-3: its slice of the parameter shard, which is
not gathered after the step; ZeRO-2/3 read the gradient from the gradient shard). Per offloaded element the host holds 16 bytes:
master 4 + two moments 8 + gradient copy 4.

On a GPU the host buffers are pinned. With ``--overlap-cpu-optimizer-d2h-h2d`` the copies run
non-blocking on a side stream: the gradient copies overlap the device part's optimizer step, and
the parameter copies are ordered before the all-gather by a stream wait instead of a host sync.
On a CPU-only run the "device" is the CPU too: the same two optimizers and copies run, so this
path is exercised (and its results checked) without a GPU.

:class:`HybridDeviceOptimizer` looks like one torch optimizer to its owner (``param_groups`` for
the learning-rate schedule, one ``state`` dict shared by both halves for checkpoints, ``step``).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch

from ..device import get_device


def _host_buffer(numel: int) -> torch.Tensor:
    """A zeroed flat fp32 host tensor, pinned when the device is a GPU (so copies can be async)."""
    return torch.zeros(numel, dtype=torch.float32, pin_memory=get_device().type == "cuda")


def move_masters_to_host(pieces) -> torch.Tensor:
    """Give every piece in ``pieces`` a host fp32 master (a view of one flat buffer, which is returned)."""
    flat = _host_buffer(sum(p.master.numel() for p in pieces))
    offset = 0
    for piece in pieces:
        n = piece.master.numel()
        flat[offset : offset + n].copy_(piece.master)
        piece.master = flat[offset : offset + n]
        offset += n
    return flat


class HybridDeviceOptimizer:
    """Two torch optimizers, one over the device masters and one over the host masters.

    ``groups`` are the owner's param groups (over all masters); ``pieces`` the distributed
    optimizer's pieces (``offloaded`` ones have host masters, see :func:`move_masters_to_host`);
    ``make_optimizer(groups)`` builds one torch optimizer; ``host_masters`` is the flat host buffer.
    """

    def __init__(self, groups, pieces, make_optimizer, host_masters: torch.Tensor, overlap: bool = False):
        self.host_pieces = [p for p in pieces if p.offloaded]
        self.host_masters = host_masters
        self.host_grads = _host_buffer(host_masters.numel())
        self._grad_views, offset = [], 0
        for piece in self.host_pieces:
            self._grad_views.append(self.host_grads[offset : offset + piece.master.numel()])
            offset += piece.master.numel()
        on_host = {id(p.master) for p in self.host_pieces}
        self.state = defaultdict(dict)  # shared by both halves: keyed by master, as in one torch optimizer
        self._halves = {}  # "device" / "host": (torch optimizer, index in param_groups of each of its groups)
        for half in ("device", "host"):
            sub, index = [], []
            for i, g in enumerate(groups):
                params = [m for m in g["params"] if (id(m) in on_host) == (half == "host")]
                if params:
                    sub.append(dict(g, params=params))
                    index.append(i)
            if sub:
                optimizer = make_optimizer(sub)
                optimizer.state = self.state
                self._halves[half] = (optimizer, index)
        defaults = next(iter(self._halves.values()))[0].defaults
        self.param_groups = [{**defaults, **g} for g in groups]
        cuda = get_device().type == "cuda"
        self._stream = torch.cuda.Stream() if overlap and cuda else None

    def host_tensors(self) -> list[torch.Tensor]:
        """Every host tensor of the offloaded part (masters, gradient copy, moments): for accounting."""
        out = [self.host_masters, self.host_grads]
        for piece in self.host_pieces:
            out += [v for v in self.state.get(piece.master, {}).values() if torch.is_tensor(v) and v.dim() > 0]
        return out

    def _sync_hyperparams(self) -> None:
        """The schedule sets lr (and weight decay) on ``param_groups``: hand them to both halves."""
        for optimizer, index in self._halves.values():
            for group, i in zip(optimizer.param_groups, index):
                group.update({k: v for k, v in self.param_groups[i].items() if k != "params"})

    def _on_side_stream(self):
        return torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()

    @torch.no_grad()
    def step(self) -> None:
        """Copy the host part's gradients down, step both halves, copy the host part's params up."""
        self._sync_hyperparams()
        overlap = self._stream is not None
        if overlap:  # the gradients were produced (reduced, unscaled, clipped) on the current stream
            self._stream.wait_stream(torch.cuda.current_stream())
        with self._on_side_stream():
            for piece, view in zip(self.host_pieces, self._grad_views):
                view.copy_(piece.grad(), non_blocking=overlap)
        if "device" in self._halves:  # launched first: on a GPU its kernels run while the copies do
            self._halves["device"][0].step()
        if overlap:
            self._stream.synchronize()  # the host half needs its gradients on the host
        if "host" in self._halves:
            for piece, view in zip(self.host_pieces, self._grad_views):
                piece.master.grad = view
            self._halves["host"][0].step()
            for piece in self.host_pieces:
                piece.master.grad = None
        with self._on_side_stream():
            for piece in self.host_pieces:
                piece.param_slice().copy_(piece.master, non_blocking=overlap)
        if overlap:  # the all-gather (current stream) reads the params after the copies
            torch.cuda.current_stream().wait_stream(self._stream)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer, _ in self._halves.values():
            optimizer.zero_grad(set_to_none=set_to_none)
