"""Point-to-point transfers between neighbouring pipeline stages.

Activations travel to the next stage and their gradients back to the previous one. Every transfer
is one ``torch.distributed.batch_isend_irecv`` over the pipeline group (peers are global ranks:
``state.next_pp_rank`` / ``state.prev_pp_rank``, which wrap around, as the interleaved schedule
needs), and the combined calls (``send_forward_recv_backward`` ...) post a send and a receive in
the same batch so neither neighbour waits on the other's send. Within a batch the activation ops
come first and the gradient ops second on every rank, and on gloo each kind has its own tag, so a
pair of ranks that exchange both kinds (pipeline size 2 with interleaving) never mixes them up.

Buffers have the shape ``[s/tp if sequence_parallel else s, b, h]`` and the model's dtype, the same
for every micro-batch of a run, so one :class:`PipeComm` is built per run
(:meth:`PipeComm.for_activations`) and handed to every schedule call.

:func:`release_output` is Megatron's deallocation trick: once an activation has been sent, the
stage only needs its autograd graph, not its values, so the tensor's storage is swapped for one
element. The backward pass then runs autograd from the tensor's ``grad_fn`` directly
(:func:`microbatch.backward_from`), which never looks at the freed values.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...device import get_device
from ...perf.comm_volume import record, tensor_bytes

_ACT_TAG, _GRAD_TAG = 0, 1


def activation_shape(seq_length: int, micro_batch_size: int, hidden_size: int, tp_size: int = 1,
                     sequence_parallel: bool = False) -> tuple[int, int, int]:
    """Shape of the hidden states passed between stages: ``[s(/tp), b, h]``."""
    if sequence_parallel:
        if seq_length % tp_size:
            raise ValueError(
                f"--sequence-parallel needs --seq-length {seq_length} divisible by "
                f"--tensor-model-parallel-size {tp_size}"
            )
        seq_length //= tp_size
    return (seq_length, micro_batch_size, hidden_size)


def release_output(out: torch.Tensor | None) -> None:
    """Free an already-sent activation's values, keeping its autograd graph (see the module doc).

    Views are left alone: their storage belongs to their base, so swapping it would free nothing.
    """
    if out is None or out._base is not None:
        return
    out.data = torch.empty((1,), device=out.device, dtype=out.dtype)


class PipeComm:
    """Sends and receives of one pipeline rank for one activation shape and dtype.

    ``state`` (the ParallelState) travels with it: the schedules read the pipeline layout from
    ``comm.state``.
    """

    def __init__(self, state, shape, dtype):
        self.state, self.shape, self.dtype = state, tuple(shape), dtype
        self.device = get_device()
        self._tags = dist.is_initialized() and dist.get_backend(state.pp_group) == "gloo"

    @classmethod
    def for_activations(cls, state, *, seq_length: int, micro_batch_size: int, hidden_size: int,
                        dtype: torch.dtype, sequence_parallel: bool = False) -> PipeComm:
        """The communicator for hidden states ``[s(/tp), b, h]`` (see :func:`activation_shape`)."""
        shape = activation_shape(seq_length, micro_batch_size, hidden_size, state.tp_size, sequence_parallel)
        return cls(state, shape, dtype)

    # -- core --------------------------------------------------------------------------------
    def _op(self, fn, tensor, peer, tag):
        if fn is dist.isend:
            record("pp", "send", tensor_bytes(tensor), 2)
        return dist.P2POp(fn, tensor, peer, self.state.pp_group, tag if self._tags else 0)

    def communicate(self, send_next=None, send_prev=None, recv_prev=False, recv_next=False, wait=True):
        """One batch: send an activation to the next stage and/or a gradient to the previous one,
        receive an activation from the previous stage and/or a gradient from the next one.

        Returns ``(from_prev, from_next)``; a received activation requires grad (the stage will
        back-propagate into it), a received gradient does not. With ``wait=False`` the batch is only
        posted and a function is returned that waits for it and then returns the pair (the caller
        computes meanwhile, e.g. the zero-bubble schedule's weight gradients).
        """
        s = self.state
        if s.pp_size == 1:
            return (None, None) if wait else (lambda: (None, None))
        ops, from_prev, from_next = [], None, None
        # activations (towards the next stage) first ...
        if send_next is not None:
            ops.append(self._op(dist.isend, self._check(send_next, "activation"), s.next_pp_rank, _ACT_TAG))
        if recv_prev:
            from_prev = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            ops.append(self._op(dist.irecv, from_prev, s.prev_pp_rank, _ACT_TAG))
        # ... then gradients (towards the previous stage)
        if send_prev is not None:
            ops.append(self._op(dist.isend, self._check(send_prev, "gradient"), s.prev_pp_rank, _GRAD_TAG))
        if recv_next:
            from_next = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            ops.append(self._op(dist.irecv, from_next, s.next_pp_rank, _GRAD_TAG))
        requests = dist.batch_isend_irecv(ops) if ops else []

        def finish():
            for req in requests:
                req.wait()
            if from_prev is not None:
                from_prev.requires_grad_(True)
            return from_prev, from_next

        return finish() if wait else finish

    def _check(self, x, what):
        if tuple(x.shape) != self.shape:
            raise ValueError(
                f"pipeline {what} has shape {tuple(x.shape)} but the stages exchange {self.shape} "
                "([--seq-length (over --tensor-model-parallel-size with --sequence-parallel), --micro-batch-size, "
                "--hidden-size])"
            )
        if x.dtype != self.dtype:
            raise ValueError(f"pipeline {what} has dtype {x.dtype} but the stages exchange {self.dtype}")
        return x.detach().contiguous()

    # -- the named calls of the schedules (Megatron's names) ---------------------------------
    def recv_forward(self, recv=True):
        """Input activation from the previous stage (None when ``recv`` is False)."""
        return self.communicate(recv_prev=recv)[0]

    def recv_backward(self, recv=True):
        """Gradient of this stage's output from the next stage (None when ``recv`` is False)."""
        return self.communicate(recv_next=recv)[1]

    def send_forward(self, output):
        self.communicate(send_next=output)

    def send_backward(self, input_grad):
        self.communicate(send_prev=input_grad)

    def send_forward_recv_backward(self, output, recv=True):
        """Send this micro-batch's output on, get the gradient for the oldest one in flight."""
        return self.communicate(send_next=output, recv_next=recv)[1]

    def send_backward_recv_forward(self, input_grad, recv=True):
        """Send an input gradient back, get the next micro-batch's input."""
        return self.communicate(send_prev=input_grad, recv_prev=recv)[0]

    def start_send_backward_recv_forward(self, input_grad, recv=True):
        """Post :meth:`send_backward_recv_forward`; returns a function that waits and gives the input."""
        finish = self.communicate(send_prev=input_grad, recv_prev=recv, wait=False)
        return lambda: finish()[0]

    def send_forward_recv_forward(self, output, recv_prev=True):
        return self.communicate(send_next=output, recv_prev=recv_prev)[0]

    def send_backward_recv_backward(self, input_grad, recv_next=True):
        return self.communicate(send_prev=input_grad, recv_next=recv_next)[1]

    def send_forward_backward_recv_forward_backward(self, output, input_grad, recv_prev=True, recv_next=True):
        return self.communicate(send_next=output, send_prev=input_grad, recv_prev=recv_prev, recv_next=recv_next)
