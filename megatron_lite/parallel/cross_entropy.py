"""Cross-entropy over logits whose vocabulary dimension is split across the TP group.

No rank ever holds the full logits. Forward needs two collectives: an all-reduce (max) of the
per-token maximum for a stable softmax, then ONE all-reduce (sum) of the stacked per-token
statistics ``[sum exp, target logit, sum of logits]``. Backward reuses the softmax saved in place
of the logits: ``grad = softmax - (1 - eps) * onehot - eps / V``.

Padded vocabulary entries (ids >= ``vocab_size``) are excluded from the softmax, so they never
change the loss or receive a gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import comm


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, label_smoothing, vocab_size):
        size, rank = comm.group_size(group), comm.group_rank(group)
        part = logits.shape[-1]
        start = rank * part
        vocab_size = vocab_size if vocab_size is not None else part * size
        n_real = max(0, min(part, vocab_size - start))  # real (unpadded) entries in my shard

        logits = logits.float().contiguous()  # the softmax buffer below must be viewable as rows
        if n_real < part:
            logits = logits.clone()
            logits[..., n_real:] = float("-inf")
        local_max = logits.max(dim=-1).values
        if size > 1:
            comm.record("tp", "all_reduce", comm.tensor_bytes(local_max), size)
            dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - local_max.unsqueeze(-1)

        in_range = (target >= start) & (target < start + part)
        local_target = (target - start).masked_fill(~in_range, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~in_range, 0.0)
        exp = shifted.exp()
        stats = [exp.sum(dim=-1), target_logit]
        if label_smoothing > 0:
            stats.append(shifted[..., :n_real].sum(dim=-1))
        stats = torch.stack(stats)
        if size > 1:
            comm.record("tp", "all_reduce", comm.tensor_bytes(stats), size)
            dist.all_reduce(stats, group=group)  # the two (or three) sums in one collective
        sum_exp = stats[0]
        log_z = sum_exp.log()
        loss = log_z - stats[1]
        if label_smoothing > 0:
            mean_log_prob = stats[2] / vocab_size - log_z
            loss = (1.0 - label_smoothing) * loss - label_smoothing * mean_log_prob

        softmax = exp.div_(sum_exp.unsqueeze(-1))  # reuse the exp buffer
        ctx.save_for_backward(softmax, local_target, in_range)
        ctx.label_smoothing, ctx.vocab_size, ctx.n_real = label_smoothing, vocab_size, n_real
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, in_range = ctx.saved_tensors
        eps = ctx.label_smoothing
        grad = softmax  # modified in place: the forward's buffer is not needed any more
        flat = grad.view(-1, grad.shape[-1])
        rows = torch.arange(flat.shape[0], device=grad.device)
        hit = in_range.reshape(-1).to(grad.dtype)
        flat[rows, local_target.reshape(-1)] -= (1.0 - eps) * hit
        if eps > 0:
            grad[..., : ctx.n_real] -= eps / ctx.vocab_size
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    tp_group=None,
    label_smoothing: float = 0.0,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Per-token loss from this rank's vocab shard ``logits [..., V/tp]`` and full ``target [...]``.

    ``vocab_size`` is the real vocabulary size (the padded tail is ignored); the result has
    ``target``'s shape and matches ``F.cross_entropy(full_logits, target, reduction='none',
    label_smoothing=...)``. The gradient w.r.t. ``logits`` is fp32 like the loss computation.
    """
    return _VocabParallelCrossEntropy.apply(logits, target, tp_group, label_smoothing, vocab_size)
