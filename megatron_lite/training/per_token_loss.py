"""The step's loss reduction, per micro-batch mean (the default) or per token (``--calculate-per-token-loss``).

By default every micro-batch's ``loss_func`` returns the mean over its loss tokens, the schedule
divides it by the number of micro-batches and the data-parallel gradient average divides by
DP x CP: the step's loss is the mean of the micro-batch means, whatever each micro-batch holds.

With ``--calculate-per-token-loss`` (Megatron-LM's flag) ``loss_func`` returns ``(sum of token
losses, number of loss tokens, reported)`` with each reported value a pair ``[sum, count]``; the
schedule backpropagates the sum undivided and counts the tokens (:class:`Reported.num_tokens
<megatron_lite.parallel.pipeline.microbatch.Reported>`). Once the data-parallel reduction is done,
:func:`scale_grads_by_tokens` divides every gradient by the number of loss tokens of the whole
global batch (all micro-batches, DP and CP ranks), so the step minimises the mean over tokens: a
micro-batch with many loss tokens (long SFT answers, few ``--eod-mask-loss`` masks) weighs more.
The logged losses are the same figure, ``sum of sums / sum of counts`` (:func:`reduce_reported`),
and validation sums over all its iterations before dividing. Routers' auxiliary losses are
backpropagated with the loss scale alone (:func:`aux_loss_scale`), then divided with the rest, as
Megatron-LM does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..device import get_device


def aux_loss_scale(config, state, loss_scale: float, num_microbatches: int) -> float:
    """What auxiliary losses (routers', a spec module's) are multiplied by before backward: the
    main loss's factor, loss scale / micro-batches x CP, or per token the loss scale alone (the
    routers then multiply their losses by the micro-batch's token count: moe/router.py)."""
    if config.training.calculate_per_token_loss:
        return loss_scale
    return loss_scale * state.cp_size / num_microbatches


def scale_grads_by_tokens(config, chunks, state, num_tokens) -> None:
    """With --calculate-per-token-loss (else nothing): divide the gradient every rank holds by the
    number of loss tokens in the global batch.

    ``num_tokens`` is this rank's count (the last pipeline stage's; 0 elsewhere). It is summed over
    the pipeline group (so every stage has it) and the DP x CP group. The data-parallel reduction
    averaged over DP x CP, so the factor is dp x cp / tokens: the gradient of the summed token loss
    of the whole global batch, divided by its token count. A batch without loss tokens is divided by 1.
    """
    if not config.training.calculate_per_token_loss:
        return
    total = torch.zeros((), dtype=torch.float64, device=get_device()) + num_tokens
    for group in (state.pp_group, state.dp_cp_group):
        if group is not None:
            dist.all_reduce(total, group=group)
    factor = (state.dp_size * state.cp_size / total.clamp(min=1)).float()
    grads = [g for chunk in chunks for p in chunk.params if (g := chunk.owned_grad(p)).numel()]
    if grads:
        torch._foreach_mul_(grads, factor.to(grads[0].device))


def reduce_reported(reported: list[dict], state) -> dict[str, float]:
    """The step's (or the evaluation's) value of each reported loss, the same on every last-stage rank.

    Per micro-batch means: their mean, averaged over the data-parallel ranks. Pairs ``[sum,
    count]`` (per-token loss): summed over the micro-batches and the DP x CP ranks, sum / count.
    """
    if not reported:
        return {}
    keys = sorted(reported[0])
    values = [torch.stack([r[k].detach().double().reshape(-1) for r in reported]) for k in keys]
    if values[0].shape[1] == 2:  # [sum, count] per micro-batch
        pairs = torch.stack([v.sum(dim=0) for v in values])
        if state.dp_cp_group is not None:
            dist.all_reduce(pairs, group=state.dp_cp_group)
        return dict(zip(keys, (pairs[:, 0] / pairs[:, 1].clamp(min=1)).tolist()))
    means = torch.stack([torch.stack([r[k].detach().float() for r in reported]).mean() for k in keys])
    if state.dp_group is not None:
        dist.all_reduce(means, group=state.dp_group)
        means /= state.dp_size
    return dict(zip(keys, means.tolist()))


def evaluation_losses(per_iteration: list[list[dict]], state) -> dict[str, float]:
    """The validation losses of ``eval_iters`` iterations' reported dicts: per token, every token
    loss of every iteration over all their tokens; otherwise the mean of the iterations' values."""
    if not per_iteration or not per_iteration[0]:
        return {}
    first = per_iteration[0][0]
    if first and next(iter(first.values())).numel() == 2:  # [sum, count] pairs
        return reduce_reported([r for reported in per_iteration for r in reported], state)
    totals: dict[str, float] = {}
    for reported in per_iteration:
        for k, v in reduce_reported(reported, state).items():
            totals[k] = totals.get(k, 0.0) + v / len(per_iteration)
    return totals
