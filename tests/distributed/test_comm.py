"""The autograd collectives: forward values and gradients against what a single process computes."""

import torch
import torch.distributed as dist

from megatron_lite.parallel import comm
from tests.harness import run_ranks


def check_all_to_all_uneven():
    rank, world = dist.get_rank(), dist.get_world_size()
    # rank r sends (r + j + 1) rows to rank j; row values identify (sender, receiver, row)
    send_splits = [rank + j + 1 for j in range(world)]
    recv_splits = [j + rank + 1 for j in range(world)]
    rows = [torch.full((n, 3), float(100 * rank + 10 * j)) + torch.arange(n).unsqueeze(1) for j, n in enumerate(send_splits)]
    x = torch.cat(rows).requires_grad_()
    y = comm.all_to_all(x, dist.group.WORLD, output_splits=recv_splits, input_splits=send_splits)
    expected = torch.cat(
        [torch.full((n, 3), float(100 * j + 10 * rank)) + torch.arange(n).unsqueeze(1) for j, n in enumerate(recv_splits)]
    )
    torch.testing.assert_close(y, expected, rtol=0, atol=0)
    # backward routes each row's gradient back to the row it came from
    (y * (y + 1)).sum().backward()
    torch.testing.assert_close(x.grad, 2 * x.detach() + 1, rtol=0, atol=0)


def check_sequence_parallel_ops():
    rank, world = dist.get_rank(), dist.get_world_size()
    g = dist.group.WORLD
    full = torch.arange(world * 2 * 3, dtype=torch.float32).view(world * 2, 3)
    mine = full.chunk(world)[rank].clone().requires_grad_()
    gathered = comm.gather_from_sp(mine, g, tensor_parallel_output_grad=True)
    torch.testing.assert_close(gathered, full)
    # every rank contributes a gradient of the whole sequence; mine is the sum over ranks of my chunk
    (gathered * (rank + 1)).sum().backward()
    torch.testing.assert_close(mine.grad, torch.full_like(mine, world * (world + 1) / 2))

    mine2 = full.chunk(world)[rank].clone().requires_grad_()
    (comm.gather_from_sp(mine2, g, tensor_parallel_output_grad=False) * (rank + 1)).sum().backward()
    torch.testing.assert_close(mine2.grad, torch.full_like(mine2, rank + 1.0))

    partial = (full * (rank + 1)).requires_grad_()
    reduced = comm.reduce_scatter_to_sp(partial, g)
    torch.testing.assert_close(reduced, full.chunk(world)[rank] * world * (world + 1) / 2)
    reduced.sum().backward()
    torch.testing.assert_close(partial.grad, torch.ones_like(full))

    x = torch.randn(4, world * 2, generator=torch.Generator().manual_seed(0)).requires_grad_()
    part = comm.scatter_to_tp(x, g)
    torch.testing.assert_close(part, x.chunk(world, dim=-1)[rank])
    whole = comm.gather_from_tp(part * 2, g)
    torch.testing.assert_close(whole, 2 * x)
    whole.sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))  # each rank's slice grad, all-gathered


def test_all_to_all_uneven_splits():
    run_ranks(4, check_all_to_all_uneven)


def test_sequence_and_tensor_parallel_regions():
    run_ranks(2, check_sequence_parallel_ops)
    run_ranks(4, check_sequence_parallel_ops)


def test_groups_of_one_are_identity():
    x = torch.randn(4, 6, requires_grad=True)
    for fn in (comm.copy_to_tp, comm.reduce_from_tp, comm.scatter_to_tp, comm.gather_from_tp,
               comm.scatter_to_sp, comm.gather_from_sp, comm.reduce_scatter_to_sp, comm.all_to_all):
        assert fn(x, None) is x


def check_states_share_groups():
    """Process groups are created once per rank list: a second state of the same shape (another
    training run in the same process) reuses them instead of adding gloo threads, and they work."""
    from megatron_lite.parallel.state import ParallelState

    created = []
    new_group = dist.new_group

    def counting(*args, **kwargs):
        created.append(args)
        return new_group(*args, **kwargs)

    dist.new_group = counting
    try:
        a = ParallelState(tp=2, pp=2)
        first = len(created)
        b = ParallelState(tp=2, pp=2)
        assert len(created) == first  # nothing new
    finally:
        dist.new_group = new_group
    assert all(b.group(n) is a.group(n) for n in ("tp", "pp", "dp", "mp", "embedding"))
    c = ParallelState(tp=4)
    assert c.tp_group is not b.tp_group and dist.get_world_size(c.tp_group) == 4
    t = torch.ones(1)
    dist.all_reduce(t, group=b.tp_group)
    return t.item()


def test_parallel_states_of_one_shape_share_their_groups():
    assert run_ranks(4, check_states_share_groups) == [2.0] * 4
