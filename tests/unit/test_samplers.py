"""Samplers: resume exactness, disjoint and covering data-parallel slices, collate, iterators."""

import itertools

import numpy as np
import pytest
import torch

from megatron_lite.data.samplers import (
    PretrainingSampler,
    RandomPretrainingSampler,
    build_data_iterators,
    collate,
)


def run(sampler_cls, total, consumed, mbs, dp, steps=None, **kw):
    """Per-rank lists of micro-batches."""
    out = []
    for r in range(dp):
        it = iter(sampler_cls(total, consumed, mbs, r, dp, **kw))
        out.append(list(itertools.islice(it, steps)) if steps else list(it))
    return out


@pytest.mark.parametrize("total,mbs,dp", [(100, 4, 1), (103, 2, 3), (64, 8, 8), (50, 3, 4)])
def test_sequential_sampler_layout_disjoint_and_covering(total, mbs, dp):
    per_rank = run(PretrainingSampler, total, 0, mbs, dp)
    steps = total // (mbs * dp)
    assert all(len(batches) == steps for batches in per_rank)
    for k in range(steps):
        step = [per_rank[r][k] for r in range(dp)]
        # Megatron layout: step k is indices [k*G, (k+1)*G), rank r takes slice r of micro-batch size.
        assert sum(step, []) == list(range(k * mbs * dp, (k + 1) * mbs * dp))
        assert all(len(b) == mbs for b in step)
    assert len(PretrainingSampler(total, 0, mbs, 0, dp)) == steps


@pytest.mark.parametrize("sampler_cls", [PretrainingSampler, RandomPretrainingSampler])
def test_resumed_sampler_continues_exactly(sampler_cls):
    total, mbs, dp = 90, 3, 2
    steps = 40  # > one epoch for the random sampler (15 steps per epoch)
    full = run(sampler_cls, total, 0, mbs, dp, steps=steps)
    for done in (0, 1, 7, 14, 15, 16, 29):
        if sampler_cls is PretrainingSampler and done >= 15:
            continue
        resumed = run(sampler_cls, total, done * mbs * dp, mbs, dp, steps=steps - done)
        for r in range(dp):
            assert resumed[r] == full[r][done:done + len(resumed[r])]


def test_random_sampler_epochs_are_permutations_split_across_ranks():
    total, mbs, dp = 60, 5, 3
    per_rank = run(RandomPretrainingSampler, total, 0, mbs, dp, steps=8, seed=3)  # 4 steps/epoch
    for epoch in range(2):
        got = sorted(sum((per_rank[r][k] for r in range(dp) for k in range(4 * epoch, 4 * epoch + 4)), []))
        assert got == list(range(total))  # each epoch: every sample once, ranks disjoint
    epoch0 = [per_rank[0][k] for k in range(4)]
    assert sum(epoch0, []) != list(range(0, 20))  # actually shuffled


def _stream(sampler_cls, total, consumed, mbs, dp, steps):
    """The samples read, step by step, ranks in order: what the global batches are made of."""
    per_rank = run(sampler_cls, total, consumed, mbs, dp, steps=steps)
    return [i for k in range(steps) for r in range(dp) for i in per_rank[r][k]]


@pytest.mark.parametrize("total", [60, 61, 97])
def test_random_sampler_global_batches_do_not_depend_on_the_layout(total):
    """--dataloader-type cyclic: the same samples in the same global batches at any data-parallel and
    micro-batch size, across epochs, also resumed at another layout (as a torch_dist checkpoint
    does). The epochs were total // (mbs x dp) steps long (the rest dropped), so from the first
    epoch's end on the global batches depended on the layout."""
    n = 240  # 4 global batches of 60 / 2 to 4 epochs
    reference = _stream(RandomPretrainingSampler, total, 0, 1, 1, n)
    for mbs, dp in ((2, 1), (1, 4), (3, 2), (5, 3), (4, 4)):
        assert _stream(RandomPretrainingSampler, total, 0, mbs, dp, n // (mbs * dp)) == reference, (mbs, dp)
    for consumed, mbs, dp in ((60, 5, 3), (120, 2, 3), (180, 4, 1)):  # resumed at a global batch boundary
        assert _stream(RandomPretrainingSampler, total, consumed, mbs, dp, (n - consumed) // (mbs * dp)) == \
            reference[consumed:]
    for e in range(n // total):  # each whole epoch is every sample once
        assert sorted(reference[e * total:(e + 1) * total]) == list(range(total))


def test_partial_last_step_kept_without_drop_last():
    batches = run(PretrainingSampler, 10, 0, 2, 2, drop_last=False)
    assert batches[0] == [[0, 1], [4, 5], [8, 9]] and batches[1] == [[2, 3], [6, 7]]


class _Toy:
    def __len__(self):
        return 20

    def __getitem__(self, i):
        return {"tokens": np.full(4, i, dtype=np.int64), "loss_mask": np.ones(4, dtype=np.float32),
                "attention_mask": np.zeros((1, 4, 4), dtype=bool)}


def test_collate_and_iterators():
    batch = collate([_Toy()[i] for i in (3, 5)])
    assert batch["tokens"].dtype == torch.int64 and batch["tokens"].shape == (2, 4)
    assert batch["loss_mask"].dtype == torch.float32 and batch["attention_mask"].shape == (2, 1, 4, 4)
    assert batch["tokens"][1, 0].item() == 5
    train, valid, test = build_data_iterators(_Toy(), _Toy(), None, consumed_train_samples=8,
                                              consumed_valid_samples=16, micro_batch_size=2,
                                              data_parallel_rank=1, data_parallel_size=2)
    assert test is None
    assert [b["tokens"][:, 0].tolist() for b in train] == [[10, 11], [14, 15], [18, 19]]
    # valid starts at 16, then wraps around to the beginning forever
    assert [next(valid)["tokens"][:, 0].tolist() for _ in range(3)] == [[18, 19], [2, 3], [6, 7]]
