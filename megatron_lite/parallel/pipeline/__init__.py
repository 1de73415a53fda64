"""Pipeline parallelism: layer partition, stage-to-stage transfers, schedules (1F1B, interleaved,
ZB-H1 zero bubble) and their traces."""

from .p2p import PipeComm
from .partition import layer_ranges, num_chunks, pipeline_ranges
from .schedules import (
    forward_backward_no_pipelining,
    forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving,
    forward_backward_pipelining_zero_bubble,
    get_forward_backward_func,
)
from .trace import Event, Trace, bubble_fraction, render_grid, simulate, simulated_orders
from .wgrad import WeightGradStore

__all__ = [
    "Event", "PipeComm", "Trace", "WeightGradStore", "bubble_fraction", "forward_backward_no_pipelining",
    "forward_backward_pipelining_with_interleaving", "forward_backward_pipelining_without_interleaving",
    "forward_backward_pipelining_zero_bubble", "get_forward_backward_func", "layer_ranges", "num_chunks", "pipeline_ranges",
    "render_grid", "simulate", "simulated_orders",
]
