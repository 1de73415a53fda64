"""A distributed script that ends with collectives in flight: asynchronous all-reduces over a
subgroup and the default group, never waited, on tensors with Python state that it drops at once,
so only gloo's worker threads still hold them. Ended through ``run_script``, it must exit 0 with no
thread left (left to interpreter exit, a worker freeing such a tensor aborted the process)."""

import torch
import torch.distributed as dist

from megatron_lite.device import init_distributed
from megatron_lite.errors import run_script
from megatron_lite.parallel.state import ParallelState


def main() -> None:
    init_distributed()
    state = ParallelState(tp=1, pp=1, cp=1, ep=1)
    for group in (state.dp_group, None) * 10:
        t = torch.nn.Parameter(torch.ones(1 << 14))
        t.kind = "a tensor with Python state"
        dist.all_reduce(t.data, group=group, async_op=True)
        del t


if __name__ == "__main__":
    run_script(main)
