"""Distributed optimizer (``--use-distributed-optimizer``): optimizer state sharded over DP ranks.

"DP" here is the group the dense gradients are reduced over: data x context parallel (the
buckets' group), so with context parallelism the state is sharded over dp x cp ranks.

Every data-parallel replica holds the full model, but only 1/dp of the fp32 master weights and
Adam moments. The ownership follows the DDP grad buffer: each bucket (padded to a multiple of the
group size) is cut into dp equal chunks and rank i owns chunk i. Per iteration:

1. DDP **reduce-scatters** each bucket (instead of all-reducing it): rank i receives the averaged
   gradient of its chunk only (``bucket.reduce_scatter = True``, set here).
2. The torch optimizer steps this rank's *pieces*: for every parameter overlapping the owned
   chunk, a flat fp32 master of the overlapping range, whose gradient is that range of
   ``main_grad``. AdamW is elementwise, so stepping pieces equals stepping whole tensors.
   Overflow check, grad norm and clipping work on the pieces, summed over the DP group too.
3. Each rank writes its updated pieces (in the param dtype) into its chunk of a bucket-sized
   buffer and the buffers are **all-gathered**, giving every rank every updated parameter.

Memory per parameter with bf16 params over d ranks: 2 (param) + 4 (grad) + 12/d (master + Adam).
Communication equals a plain all-reduce (reduce-scatter + all-gather).

``state_dict()`` is collective over the data-parallel group (every DP rank must call it; the
others' results can be discarded): it gathers the shards into the same format
:class:`MegatronOptimizer` writes, so checkpoints move freely between optimizers and DP sizes.
``load_state_dict`` needs no communication: each rank takes its slices from the full state.

Hybrid sharding (``--num-distributed-optimizer-instances``) needs nothing here: the buckets' group
is then the shard group (expert buckets: one instance of the expert-data-parallel group), so pieces,
all-gathers and the grad norm follow it. With
``--optimizer-cpu-offload`` part of the pieces move to the host (optim/cpu_offload.py); the
checkpoint format does not change.
The same class serves the sharded-gradient strategies (``optim_grads``, ``optim_grads_params``):
a piece's gradient is read from the bucket's ``owned_grad()`` (this rank's chunk, whether the full
buffer is kept or only the shard), and with sharded parameters (``bucket.param_shard``) the
updated pieces are written into that shard instead of being all-gathered. With
``--overlap-param-gather`` the post-step all-gathers are left in flight; each module waits for its
buckets just before its next forward (``bucket.finish_param_gather``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..device import get_device
from ..parallel import comm
from .clip_grads import grad_norm_squared
from .cpu_offload import HybridDeviceOptimizer, move_masters_to_host
from .optimizer import MegatronOptimizer, decays, regroup_saved_state


class _Piece:
    """The part ``[lo, hi)`` (flat, in the param) of one parameter owned by this rank."""

    def __init__(self, param, bucket, lo, hi):
        self.param, self.bucket, self.lo, self.hi = param, bucket, lo, hi
        # where the piece sits inside this rank's chunk of the bucket
        self.chunk_offset = bucket.offsets[id(param)][0] + lo - bucket.shard()[0]
        self.master = self.current().float().clone()
        self.offloaded = False  # True: the master lives on the host (optimizer CPU offload)

    def _in_chunk(self, chunk: torch.Tensor) -> torch.Tensor:
        return chunk[self.chunk_offset : self.chunk_offset + self.hi - self.lo]

    def current(self) -> torch.Tensor:
        """The model's value of the piece (from the param shard when the params are sharded)."""
        if self.bucket.param_shard is not None:
            return self._in_chunk(self.bucket.param_shard)
        return self.param.detach().reshape(-1)[self.lo : self.hi]

    def grad(self) -> torch.Tensor:
        return self._in_chunk(self.bucket.owned_grad())

    def param_slice(self) -> torch.Tensor:
        """Where the model keeps the piece: a slice of the param, or of the param shard (ZeRO-3)."""
        if self.bucket.param_shard is not None:
            return self._in_chunk(self.bucket.param_shard)
        return self.param.view(-1)[self.lo : self.hi]

    def updated(self) -> torch.Tensor:
        """The stepped values to all-gather: an offloaded master was already copied into the param."""
        return self.param_slice() if self.offloaded else self.master

    def split(self, n: int) -> list[_Piece]:
        """This piece as two: its first ``n`` elements and the rest."""
        return [_Piece(self.param, self.bucket, self.lo, self.lo + n), _Piece(self.param, self.bucket, self.lo + n, self.hi)]


class DistributedOptimizer(MegatronOptimizer):
    """:class:`MegatronOptimizer` with fp32 masters and optimizer state sharded over data parallel."""

    def _make_masters(self) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """This rank's pieces (called by the base ``__init__``): (param, flat fp32 master of the owned range)."""
        self.buckets = [b for chunk in self.chunks for b in chunk.buckets]
        for bucket in self.buckets:  # parameters are all-gathered one bucket at a time, in one dtype
            dtypes = {p.dtype for p in bucket.params}
            if len(dtypes) > 1:
                raise ValueError(f"--use-distributed-optimizer needs one parameter dtype per gradient bucket, got {dtypes}")
        self.pieces: list[_Piece] = []
        self._bucket_of_param = {id(p): b for b in self.buckets for p in b.params}
        for bucket in self.buckets:
            bucket.reduce_scatter = True
            start, end = bucket.shard()
            for p in bucket.params:
                a, e = bucket.offsets[id(p)]
                lo, hi = max(a, start), min(e, end)
                if lo < hi:
                    self.pieces.append(_Piece(p, bucket, lo - a, hi - a))
        self.host_masters = None
        if getattr(self.config, "optimizer_cpu_offload", False):
            self._offload(self.config.optimizer_offload_fraction)
        else:
            self._flat_masters()
        return [(piece.param, piece.master) for piece in self.pieces]

    def _flat_masters(self) -> None:
        """Buckets whose params live in flat storage (``bucket.param_data``): this rank's chunk of it
        in fp32 (``bucket.master_data``) holds the masters of its pieces (views), so after the step the
        chunk is written and all-gathered straight into the params' storage in one go."""
        for bucket in self.buckets:
            if bucket.param_data is None or bucket.param_shard is not None:
                continue
            start, end = bucket.shard()
            bucket.master_data = bucket.param_data[start:end].to(torch.float32, copy=True)  # fp32 params too
        for piece in self.pieces:
            if piece.bucket.master_data is not None:
                piece.master = piece.bucket.master_data[piece.chunk_offset : piece.chunk_offset + piece.hi - piece.lo]

    def _offload(self, fraction: float) -> None:
        """Move the first ``fraction`` of the owned elements (rounded to an element) to the host."""
        budget = round(fraction * sum(piece.hi - piece.lo for piece in self.pieces))
        pieces = []
        for piece in self.pieces:
            n = piece.hi - piece.lo
            if 0 < budget < n:  # cut: the head goes to the host, the rest stays
                head, piece = piece.split(budget)
                head.offloaded, budget = True, 0
                pieces.append(head)
            elif budget >= n:
                piece.offloaded, budget = True, budget - n
            pieces.append(piece)
        self.pieces = pieces
        self.host_masters = move_masters_to_host([piece for piece in pieces if piece.offloaded])

    def _make_torch_optimizer(self, groups):
        if not groups:  # this rank owns only padding: keep an optimizer with an empty tensor
            groups = [{"params": [torch.zeros(0)], "weight_decay": 0.0}]
        elif self.host_masters is not None:  # optimizer CPU offload: a device half and a host half
            return HybridDeviceOptimizer(groups, self.pieces, super()._make_torch_optimizer, self.host_masters,
                                         overlap=self.config.overlap_cpu_optimizer_d2h_h2d)
        return super()._make_torch_optimizer(groups)

    sharded = True

    def stat_pairs(self, grads: bool) -> list:
        """This rank's pieces as ``(model param, fp32 master or, with grads, its gradient)``."""
        return [(piece.param, piece.grad() if grads else piece.master) for piece in self.pieces]

    # step ----------------------------------------------------------------------------------
    def _grad_norm(self) -> float:
        device = self.buckets[0].device if self.buckets else torch.device("cpu")
        pairs = [(piece.param, piece.grad()) for piece in self.pieces]
        return grad_norm_squared(pairs, self.state, device, data_parallel=True).sqrt().item()

    @torch.no_grad()
    def step(self) -> tuple[bool, float | None]:
        grads = [piece.grad() for piece in self.pieces]
        for piece, grad in zip(self.pieces, grads):
            if not piece.offloaded:  # the host half copies its gradients itself
                piece.master.grad = grad
        if self.scaler is not None:
            groups = (self.state.dp_cp_group, self.state.mp_group, self.state.ep_group)
            found_inf = self._unscale_and_check(grads, groups)
            self.scaler.update(found_inf)
            if found_inf:
                self.num_skipped_steps += 1
                self._drop_grads()
                return False, None
        grad_norm = self._grad_norm()
        self._step_clipped(grad_norm, grads)
        self._drop_grads()
        self._gather_params()
        return True, grad_norm

    def _drop_grads(self) -> None:
        for piece in self.pieces:
            piece.master.grad = None

    def _gather_params(self) -> None:
        """Every rank writes its updated pieces; an all-gather per bucket gives everyone everything
        (left in flight with --overlap-param-gather). Sharded params: the pieces go into the shard."""
        for piece in self.pieces:
            if piece.bucket.param_shard is not None and not piece.offloaded:  # offloaded: written by the host half
                piece.current().copy_(piece.master)
        overlap = getattr(self.chunks[0], "overlap_param_gather", False)
        for bucket in self.buckets:
            if bucket.param_shard is not None:
                continue
            if bucket.master_data is not None:
                bucket.param_gather = self._gather_flat(bucket, overlap)
            else:
                bucket.param_gather = self._all_gather_bucket(bucket, bucket.params[0].dtype,
                                                              lambda piece: piece.updated(), async_op=overlap)
            if not overlap:
                bucket.finish_param_gather()

    def _gather_flat(self, bucket, async_op: bool):
        """This rank's updated chunk, in the params' dtype, all-gathered into the params' flat storage."""
        local = bucket.master_data.to(bucket.param_data.dtype)
        if comm.group_size(bucket.group) == 1:
            bucket.param_data.copy_(local)
            return None, None
        comm.record("dp", "all_gather", comm.tensor_bytes(bucket.param_data), comm.group_size(bucket.group))
        bucket.gather_input = local  # alive until the (possibly asynchronous) all-gather is done
        return comm.all_gather_single(bucket.param_data, local, group=bucket.group, async_op=async_op), None

    def _all_gather_bucket(self, bucket, dtype, value_of, async_op: bool | None = None):
        """The whole bucket (flat) from each rank's shard, filled by ``value_of(piece)`` for its pieces.
        With ``async_op`` given: (handle or None, buffer) for :meth:`Bucket.finish_param_gather`."""
        full = torch.zeros(bucket.numel, dtype=dtype, device=bucket.device)
        start, end = bucket.shard()
        local = full[start:end].clone()
        for piece in self.pieces:
            if piece.bucket is bucket:
                local[piece.chunk_offset : piece.chunk_offset + piece.hi - piece.lo] = value_of(piece)
        if comm.group_size(bucket.group) == 1:
            return local if async_op is None else (None, local)
        comm.record("dp", "all_gather", comm.tensor_bytes(full), comm.group_size(bucket.group))
        handle = comm.all_gather_single(full, local, group=bucket.group, async_op=bool(async_op))
        return full if async_op is None else (handle, full)

    def zero_grad(self) -> None:
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self._drop_grads()

    @torch.no_grad()
    def reload_model_params(self) -> None:
        for piece in self.pieces:
            piece.master.copy_(piece.current())

    # checkpoint ----------------------------------------------------------------------------
    def shard_slots(self) -> list[tuple[torch.nn.Parameter, torch.Tensor, int, int]]:
        """This rank's pieces as ``(model param, flat fp32 master, lo, hi)``."""
        return [(piece.param, piece.master, piece.lo, piece.hi) for piece in self.pieces]

    def _full_order(self) -> list:
        """Model params in the index order of MegatronOptimizer's torch state dict."""
        ps = self.model_params
        return [p for p in ps if decays(p)] + [p for p in ps if not decays(p)]

    def _gather_full(self, value_of, dtype=torch.float32) -> dict[int, torch.Tensor]:
        """{id(param): full tensor in ``dtype``} from each rank's pieces (``value_of(piece)`` gives a piece's values)."""
        out = {}
        for bucket in self.buckets:
            full = self._all_gather_bucket(bucket, dtype, value_of)
            for p in bucket.params:
                a, e = bucket.offsets[id(p)]
                out[id(p)] = full[a:e].view(p.shape).clone()
        return out

    def state_dict(self) -> dict:
        """Collective over data parallel: the full state in MegatronOptimizer's format."""
        order = self._full_order()
        masters = self._gather_full(lambda piece: piece.master)
        step = self._step_count()
        has_state = torch.tensor(float(any(piece.master in self.optimizer.state for piece in self.pieces)),
                                 device=get_device())
        if comm.group_size(self.state.dp_cp_group) > 1:  # ranks owning only padding have no state
            dist.all_reduce(has_state, op=dist.ReduceOp.MAX, group=self.state.dp_cp_group)
        torch_state = {}
        if has_state.item():
            keys = {"adam": ["exp_avg", "exp_avg_sq"], "sgd": ["momentum_buffer"]}[self.config.optimizer]
            full_state = {k: self._gather_full(lambda piece, k=k: self._state_of(piece, k),  # in its stored dtype
                                               self.moment_dtypes.get(k, torch.float32)) for k in keys}
            for index, p in enumerate(order):
                entry = {k: full_state[k][id(p)] for k in keys}
                if self.config.optimizer == "adam":
                    entry["step"] = torch.tensor(float(step))
                torch_state[index] = entry
        decay = [i for i, p in enumerate(order) if decays(p)]
        no_decay = [i for i, p in enumerate(order) if not decays(p)]
        template = {k: v for k, v in self.optimizer.param_groups[0].items() if k not in ("params", "weight_decay")}
        groups = [dict(template, weight_decay=wd, params=ids)
                  for wd, ids in ((self.config.weight_decay, decay), (0.0, no_decay)) if ids]
        return {
            "optimizer": {"state": torch_state, "param_groups": groups},
            "fp32_masters": [masters[id(p)] for p in self.model_params],
            "loss_scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "num_skipped_steps": self.num_skipped_steps,
        }

    def _state_of(self, piece, key) -> torch.Tensor:
        value = self.optimizer.state.get(piece.master, {}).get(key)
        dtype = self.moment_dtypes.get(key, piece.master.dtype)
        return torch.zeros_like(piece.master, dtype=dtype) if value is None else value

    def _step_count(self) -> int:
        """Adam's step counter (the same on every piece and rank); agreed with a MAX over DP."""
        steps = [float(s["step"]) for s in self.optimizer.state.values() if "step" in s]
        value = torch.tensor(max(steps, default=0.0), device=get_device())
        if comm.group_size(self.state.dp_cp_group) > 1:
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.state.dp_cp_group)
        return int(value.item())

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        """Take this rank's slices of a full (MegatronOptimizer-format) state; no communication."""
        order = self._full_order()
        index_of = {id(p): i for i, p in enumerate(order)}
        saved_state = regroup_saved_state(sd["optimizer"], self.model_params)["state"]
        masters = sd.get("fp32_masters")
        if masters is not None and len(masters) != len(self.model_params):
            raise ValueError(
                f"optimizer checkpoint holds {len(masters)} master weights but the model has "
                f"{len(self.model_params)} parameters; was it saved with a different model or parallel layout?"
            )
        full_master = {id(p): m for p, m in zip(self.model_params, masters)} if masters is not None else None
        fused = bool(self.optimizer.param_groups[0].get("fused"))
        for piece in self.pieces:
            source = full_master[id(piece.param)] if full_master is not None else piece.param
            piece.master.copy_(source.reshape(-1)[piece.lo : piece.hi])
            entry = saved_state.get(index_of[id(piece.param)])
            if entry is None:
                self.optimizer.state.pop(piece.master, None)
                continue
            new = {}
            for k, v in entry.items():
                if torch.is_tensor(v) and v.dim() > 0:
                    dtype = self.moment_dtypes.get(k, piece.master.dtype)  # cast: fp32 <-> bf16 moments
                    new[k] = v.reshape(-1)[piece.lo : piece.hi].to(piece.master.device, dtype, copy=True)
                elif torch.is_tensor(v):  # Adam's step: fused kernels want it beside the param, in fp32
                    new[k] = v.to(piece.master.device, torch.float32, copy=True) if fused else v.clone()
                else:
                    new[k] = v
            self.optimizer.state[piece.master] = new
        self.note_saved_hyper(sd["optimizer"]["param_groups"][0])
        if full_master is not None:
            for p in self.model_params:
                if self._bucket_of_param[id(p)].param_shard is None:
                    p.copy_(full_master[id(p)])
            for piece in self.pieces:
                if piece.bucket.param_shard is not None:
                    piece.current().copy_(piece.master)
        if self.scaler is not None and sd.get("loss_scaler") is not None:
            self.scaler.load_state_dict(sd["loss_scaler"])
        self.num_skipped_steps = int(sd.get("num_skipped_steps", 0))
