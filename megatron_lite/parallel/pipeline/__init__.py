"""Pipeline parallelism: layer partition, stage-to-stage transfers, schedules and their traces."""

from .p2p import PipeComm
from .partition import layer_ranges, num_chunks
from .schedules import (
    forward_backward_no_pipelining,
    forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving,
    get_forward_backward_func,
)
from .trace import Event, Trace, bubble_fraction, render_grid, simulate, simulated_orders

__all__ = [
    "Event", "PipeComm", "Trace", "bubble_fraction", "forward_backward_no_pipelining",
    "forward_backward_pipelining_with_interleaving", "forward_backward_pipelining_without_interleaving",
    "get_forward_backward_func", "layer_ranges", "num_chunks", "render_grid", "simulate", "simulated_orders",
]
