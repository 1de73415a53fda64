"""Which sample indices each data-parallel rank reads, resumable to the exact sample.

Megatron's pretraining layout: global step k of training reads the ``micro_batch_size * dp_size``
consecutive indices after the ones already consumed; data-parallel rank r takes the r-th slice of
``micro_batch_size`` of them.  So the ranks' micro-batches of a step are disjoint and together cover
it, and a run resumed after C consumed samples (C saved in the checkpoint) reads exactly what the
uninterrupted run would have read from that point on.  (With gradient accumulation a global batch
is several such steps in a row; the sampler does not need to know.)

``RandomPretrainingSampler`` is the "cyclic" variant for finetuning / multi-epoch loops: an endless
stream of epochs, each a fresh permutation seeded by (seed, epoch), cut into the same per-step
layout (so its global batches, too, are the same at any data-parallel size), also resumable from a
consumed-sample count.

``collate`` stacks a list of sample dicts into a dict of torch tensors;
``build_pretraining_data_loader`` / ``build_data_iterators`` wire it all into torch DataLoaders.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import torch

from megatron_lite.data.builder import DataConfigError


def _check(total_samples: int, consumed_samples: int, micro_batch_size: int, rank: int, size: int) -> None:
    if total_samples <= 0:
        raise ValueError(f"no samples to draw from (total_samples={total_samples})")
    if micro_batch_size <= 0:
        raise ValueError(f"--micro-batch-size must be positive, got {micro_batch_size}")
    if not 0 <= rank < size:
        raise ValueError(f"data_parallel_rank {rank} not in [0, {size})")
    if consumed_samples < 0:
        raise ValueError(f"consumed_samples must be >= 0, got {consumed_samples}")


class PretrainingSampler:
    """Sequential, resumable sampler: yields this rank's micro-batch (list of indices) per step."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, drop_last: bool = True):
        _check(total_samples, consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size)
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.rank = data_parallel_rank
        self.step_size = micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        remaining = max(0, self.total_samples - self.consumed_samples)
        full, rest = divmod(remaining, self.step_size)
        partial = rest > self.rank * self.micro_batch_size and not self.drop_last
        return full + int(partial)

    def __iter__(self) -> Iterator[list[int]]:
        begin = self.rank * self.micro_batch_size
        for step_start in range(self.consumed_samples, self.total_samples, self.step_size):
            step_end = step_start + self.step_size
            if step_end > self.total_samples:  # a last, partial step
                if self.drop_last:
                    return
                step_end = self.total_samples
            lo, hi = step_start + begin, min(step_start + begin + self.micro_batch_size, step_end)
            if lo < hi:
                yield list(range(lo, hi))


class RandomPretrainingSampler:
    """Endless epochs of seeded permutations of [0, total_samples), same per-step layout, resumable.

    The samples form one stream: epoch e is the permutation seeded by (seed, e) of all
    ``total_samples``, and the epochs follow each other. Step k reads the ``micro_batch_size *
    dp_size`` stream positions after ``consumed_samples + k * step``, rank r its r-th micro-batch of
    them (a step may span two epochs). So the samples of every global batch depend on neither the
    data-parallel size nor the micro-batch size: a run resumed at another layout (a ``torch_dist``
    checkpoint) reads what the old layout would have read, and no epoch drops a remainder.
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, seed: int = 1234):
        _check(total_samples, consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size)
        self.step_size = micro_batch_size * data_parallel_size
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.rank = data_parallel_rank
        self.seed = seed

    def epoch_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.total_samples)

    def __iter__(self) -> Iterator[list[int]]:
        orders: dict[int, np.ndarray] = {}  # the epochs the current micro-batch spans (at most a few)
        for start in itertools.count(self.consumed_samples + self.rank * self.micro_batch_size, self.step_size):
            positions = np.arange(start, start + self.micro_batch_size)
            epochs, offsets = np.divmod(positions, self.total_samples)
            orders = {e: orders[e] if e in orders else self.epoch_order(e) for e in map(int, np.unique(epochs))}
            yield [int(orders[int(e)][o]) for e, o in zip(epochs, offsets)]


def collate(samples: list[dict]) -> dict[str, torch.Tensor]:
    """Stack sample dicts (numpy arrays / scalars) into one dict of torch tensors, batch dim first."""
    return {key: torch.from_numpy(np.stack([np.asarray(s[key]) for s in samples])) for key in samples[0]}


def _one_thread(_worker_id: int) -> None:
    torch.set_num_threads(1)


def build_pretraining_data_loader(dataset, consumed_samples: int, micro_batch_size: int,
                                  data_parallel_rank: int, data_parallel_size: int,
                                  dataloader_type: str = "single", num_workers: int = 0,
                                  seed: int = 1234) -> torch.utils.data.DataLoader | None:
    """A DataLoader yielding collated micro-batches of this rank ("single" or "cyclic" order)."""
    if dataset is None:
        return None
    if dataloader_type == "single":
        sampler = PretrainingSampler(len(dataset), consumed_samples, micro_batch_size,
                                     data_parallel_rank, data_parallel_size)
    elif dataloader_type == "cyclic":
        sampler = RandomPretrainingSampler(len(dataset), consumed_samples, micro_batch_size,
                                           data_parallel_rank, data_parallel_size, seed=seed)
    else:
        raise ValueError(f"--dataloader-type {dataloader_type!r} is not one of 'single', 'cyclic'")
    # Its own generator: creating an iterator draws a worker base seed, and from the default CPU
    # generator that draw would shift the dropout stream, so a resumed run would not repeat the masks.
    generator = torch.Generator().manual_seed(seed + consumed_samples)
    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                       collate_fn=collate, worker_init_fn=_one_thread if num_workers else None,
                                       generator=generator)


def cyclic_batches(dataset, consumed_samples: int, micro_batch_size: int, data_parallel_rank: int,
                   data_parallel_size: int, num_workers: int = 0) -> Iterator:
    """Sequential micro-batches forever: from consumed_samples to the end, then again from 0."""
    while True:
        loader = build_pretraining_data_loader(dataset, consumed_samples, micro_batch_size,
                                               data_parallel_rank, data_parallel_size, "single", num_workers)
        if consumed_samples == 0 and len(loader.batch_sampler) == 0:
            raise ValueError(f"dataset of {len(dataset)} samples is smaller than one step of "
                             f"{micro_batch_size * data_parallel_size} (micro-batch x data-parallel size)")
        yield from loader
        consumed_samples = 0


def build_data_iterators(train_ds, valid_ds, test_ds, consumed_train_samples: int,
                         consumed_valid_samples: int, micro_batch_size: int, data_parallel_rank: int,
                         data_parallel_size: int, dataloader_type: str = "single", num_workers: int = 0,
                         seed: int = 1234, eval_micro_batch_size: int | None = None,
                         ) -> tuple[Iterator | None, Iterator | None, Iterator | None]:
    """(train, valid, test) iterators of collated micro-batches; None where a dataset is None.

    Train resumes at ``consumed_train_samples`` and ends with the dataset ("single") or cycles
    through seeded epochs ("cyclic"); valid resumes at ``consumed_valid_samples`` (wrapped to the
    dataset) and, like test, cycles forever so evaluation never runs dry; both read micro-batches of
    ``eval_micro_batch_size`` (default ``micro_batch_size``: --eval-micro-batch-size).
    """
    train = build_pretraining_data_loader(train_ds, consumed_train_samples, micro_batch_size,
                                          data_parallel_rank, data_parallel_size, dataloader_type,
                                          num_workers, seed)
    iterators = [iter(train) if train is not None else None]
    micro_batch_size = micro_batch_size if eval_micro_batch_size is None else eval_micro_batch_size
    step = micro_batch_size * data_parallel_size
    for ds, consumed in ((valid_ds, consumed_valid_samples), (test_ds, 0)):
        if ds is None:
            iterators.append(None)
            continue
        usable = len(ds) - len(ds) % step
        iterators.append(cyclic_batches(ds, consumed % usable if usable else 0, micro_batch_size,
                                        data_parallel_rank, data_parallel_size, num_workers))
    return tuple(iterators)


def chunk_data_iterators(config, state, train_ds, valid_ds, consumed_train_samples: int,
                         consumed_valid_samples: int, num_chunks: int, wrap=None):
    """(train, valid) iterators for a pretrain script's ``datasets_provider``, from the run's config
    and ParallelState: one pair, or with interleaved pipelining (``num_chunks > 1``) a list per
    split with one iterator per model chunk. ``wrap(iterator)`` (optional) filters each batch stream."""

    if train_ds is None and config.training.train_iters and not config.training.skip_train:
        raise DataConfigError(f"--split {config.data.split}: the train split has weight 0, so --train-iters "
                              f"{config.training.train_iters} has nothing to train on; give it a weight "
                              "(e.g. --split 99,1,0)")

    def pair():
        t = config.training
        train, valid, _ = build_data_iterators(
            train_ds, valid_ds, None, consumed_train_samples, consumed_valid_samples, t.micro_batch_size,
            state.dp_rank, state.dp_size, dataloader_type=config.data.dataloader_type,
            num_workers=config.data.num_workers, seed=t.seed, eval_micro_batch_size=t.eval_micro_batch_size,
        )
        return tuple(it if it is None or wrap is None else wrap(it) for it in (train, valid))

    if num_chunks == 1:
        return pair()
    pairs = [pair() for _ in range(num_chunks)]
    return [p[0] for p in pairs], ([p[1] for p in pairs] if valid_ds is not None else None)
