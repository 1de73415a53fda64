"""Cross-entropy over logits whose vocabulary dimension is split across the TP group.

No rank ever holds the full logits, and the vocabulary is swept as few times as possible:

* forward: one max over this rank's shard, then one softmax of the shard in fp32 (PyTorch's
  row-wise kernel: each row is read once and written once; on a CPU, which converts 16-bit logits to
  an fp32 copy first, the softmax overwrites that copy: one logits-sized fp32 buffer, not two), then
  the largest probability per row,
  which is the max logit's. The shard's log-sum-exp follows from the two maxima:
  ``lse_local = max - log(max softmax)`` (both maxima without indices: about 4x cheaper on a CPU
  than a max that also locates its entry). Over TP, one all-reduce (max) of the ``lse_local`` and
  ONE all-reduce (sum) of the stacked per-token ``[exp(lse_local - max), target logit(, sum of
  logits)]`` give the global log-sum-exp ``lse`` and the loss ``lse - target logit``;
* backward: the saved shard softmax times ``grad x exp(lse_local - lse)`` (the global softmax scaled
  by the incoming gradient) in one pass, written in the logits' dtype, with the target entries
  (``- (1 - eps) x grad``) set exactly. Label smoothing (``eps``) adds one pass each way.

With ``fused`` (``--cross-entropy-loss-fusion``, or ``--torch-compile``, which compiles the loss) the
per-token pieces are ``jit_fuser`` functions: one kernel each when compiled. Where they would run
eagerly (the default on a CPU) the backward's scaling is the unfused :func:`scale_rows` (in place), not
the compiled expression's eager form (a new tensor; on a CPU an fp32 one first for 16-bit logits).

Padded vocabulary entries (ids >= ``vocab_size``) are excluded from the softmax, so they never
change the loss or receive a gradient: they are set to -inf in a copy of the logits, or with
``in_place`` (the language model's loss, whose logits have no other use) in the logits themselves,
which saves that copy (a pass over, and a second buffer of, ``tokens x vocab / tp`` fp32 values).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..fusions.jit import jit_fuser
from . import comm


def shard_softmax(logits: torch.Tensor, n_real: int, in_place: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 softmax over the first ``n_real`` entries of the last dim (0 for the padded rest) and the
    shard's log-sum-exp per row; ``in_place``: the padded entries of ``logits`` are overwritten."""
    if n_real == 0:  # a shard of padding only
        return torch.zeros(logits.shape, dtype=torch.float32, device=logits.device), torch.full(
            logits.shape[:-1], float("-inf"), dtype=torch.float32, device=logits.device)
    top = logits[..., :n_real].amax(dim=-1)  # amax: no indices, ~4x faster than max(dim) on a CPU
    own = False  # whether ``logits`` is now an fp32 copy of ours, which its softmax may overwrite
    if n_real < logits.shape[-1]:
        if not in_place:
            logits, own = (logits.clone() if logits.dtype == torch.float32 else logits.float()), True  # one copy
        logits[..., n_real:] = float("-inf")
    if logits.device.type == "cpu" and not torch.compiler.is_compiling():
        if logits.dtype != torch.float32:  # PyTorch's CPU softmax converts a 16-bit input to such a copy itself
            logits, own = logits.float(), True
        if own:  # in place: one logits-sized fp32 buffer, not the copy and the softmax
            softmax = torch._softmax(logits, -1, False, out=logits)
        else:
            softmax = torch.softmax(logits, dim=-1)
    else:  # (a GPU reads 16-bit logits and writes the fp32 softmax in one kernel)
        softmax = torch.softmax(logits, dim=-1, dtype=torch.float32)
    return softmax, top.float() - softmax.amax(dim=-1).log()  # the largest probability is the max logit's


def scale_rows(softmax: torch.Tensor, coef: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``softmax * coef[..., None]`` in ``dtype``: in place in fp32; else, on a GPU, written straight in
    ``dtype`` (one kernel). A CPU computes an operator whose output has another dtype into an fp32
    temporary of the output's size and converts that, so there it is scaled in place and converted."""
    if dtype == softmax.dtype:
        return softmax.mul_(coef.unsqueeze(-1))
    if softmax.device.type == "cpu":
        return softmax.mul_(coef.unsqueeze(-1)).to(dtype)
    return torch.mul(softmax, coef.unsqueeze(-1), out=torch.empty(softmax.shape, dtype=dtype, device=softmax.device))


def _scale_rows_expr(softmax: torch.Tensor, coef: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (softmax * coef.unsqueeze(-1)).to(dtype)


fused_shard_softmax = jit_fuser(shard_softmax)
fused_scale_rows = jit_fuser(_scale_rows_expr)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, label_smoothing, vocab_size, fused, in_place):
        size, rank = comm.group_size(group), comm.group_rank(group)
        part = logits.shape[-1]
        start = rank * part
        vocab_size = vocab_size if vocab_size is not None else part * size
        n_real = max(0, min(part, vocab_size - start))  # real (unpadded) entries in my shard
        logits = logits.contiguous()  # rows of the softmax and its gradient are viewed flat below

        in_range = (target >= start) & (target < start + part)
        local_target = (target - start).masked_fill(~in_range, 0)
        target_logit = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).float().masked_fill(~in_range, 0.0)
        softmax, lse_local = (fused_shard_softmax if fused else shard_softmax)(logits, n_real, in_place)
        top = lse_local
        if size > 1:
            top = lse_local.clone()
            comm.record("tp", "all_reduce", comm.tensor_bytes(top), size)
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        stats = [torch.exp(lse_local - top), target_logit]
        if label_smoothing > 0:
            stats.append(logits[..., :n_real].float().sum(dim=-1))
        stats = torch.stack(stats)
        if size > 1:
            comm.record("tp", "all_reduce", comm.tensor_bytes(stats), size)
            dist.all_reduce(stats, group=group)  # the two (or three) sums in one collective
        lse = top + stats[0].log()
        loss = lse - stats[1]
        if label_smoothing > 0:
            mean_log_prob = stats[2] / vocab_size - lse
            loss = (1.0 - label_smoothing) * loss - label_smoothing * mean_log_prob

        ratio = torch.exp(lse_local - lse) if size > 1 else None  # my shard's share of the global softmax
        ctx.save_for_backward(softmax, ratio, local_target, in_range)
        ctx.label_smoothing, ctx.vocab_size, ctx.n_real = label_smoothing, vocab_size, n_real
        ctx.dtype, ctx.fused = logits.dtype, fused
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, ratio, local_target, in_range = ctx.saved_tensors
        eps, g = ctx.label_smoothing, grad_loss.float()
        coef = g if ratio is None else g * ratio
        rows = torch.arange(local_target.numel(), device=softmax.device)
        t, hit = local_target.reshape(-1), in_range.reshape(-1)
        target_grad = softmax.view(-1, softmax.shape[-1])[rows, t] * coef.reshape(-1) - (1.0 - eps + eps / ctx.vocab_size) * g.reshape(-1)
        if eps > 0:  # the smoothing term taken off in fp32: one rounding to the logits' dtype, not two
            softmax.mul_(coef.unsqueeze(-1))[..., : ctx.n_real] -= (eps / ctx.vocab_size * g).unsqueeze(-1)
            grad = softmax.to(ctx.dtype)
        else:
            fused = ctx.fused and fused_scale_rows.compiles_for(softmax, coef)
            grad = (fused_scale_rows if fused else scale_rows)(softmax, coef, ctx.dtype)  # softmax reused in place
        flat = grad.view(-1, grad.shape[-1])
        flat[rows, t] = torch.where(hit, target_grad.to(grad.dtype), flat[rows, t])
        return grad, None, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    tp_group=None,
    label_smoothing: float = 0.0,
    vocab_size: int | None = None,
    fused: bool = False,
    in_place: bool = False,
) -> torch.Tensor:
    """Per-token loss from this rank's vocab shard ``logits [..., V/tp]`` and full ``target [...]``.

    ``vocab_size`` is the real vocabulary size (the padded tail is ignored); the result (fp32) has
    ``target``'s shape and matches ``F.cross_entropy(full_logits, target, reduction='none',
    label_smoothing=...)``. The gradient w.r.t. ``logits`` has the logits' dtype; ``fused`` runs the
    per-token pieces through ``jit_fuser``; ``in_place`` lets it write -inf into the padded entries of
    ``logits`` instead of a copy (module docstring).
    """
    return _VocabParallelCrossEntropy.apply(logits, target, tp_group, label_smoothing, vocab_size, fused, in_place)
