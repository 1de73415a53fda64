"""A dataset of one's own: a training script that keeps pretrain_gpt.py's model, batches and loss and
brings its own data, here a synthetic pattern (each sample counts up by one from a random start,
modulo ``--vocab-size``). No ``--data-path`` and no ``--mock-data``: the flags are parsed with
``data_from_script=True``, which tells the checks that this script's provider brings the data.

    python examples/research/own_dataset.py --vocab-size 64 --num-layers 2 --hidden-size 64 \\
        --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 --global-batch-size 4 --train-iters 20

A dataset is any ``len`` + ``__getitem__`` whose items are dicts of numpy arrays ``[seq-length]``:
``tokens`` and ``labels`` (int64, the labels the tokens shifted by one), ``loss_mask`` (float), and
optionally ``position_ids`` / ``document_ids``; ``chunk_data_iterators`` shards it over the
data-parallel ranks and resumes it from a checkpoint. Swap ``CountingDataset`` for your own.
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # pretrain_gpt

import pretrain_gpt  # noqa: E402
from megatron_lite.arguments import parse_args  # noqa: E402
from megatron_lite.config import ConfigError  # noqa: E402
from megatron_lite.data.builder import DataConfigError, train_valid_test_num_samples  # noqa: E402
from megatron_lite.data.samplers import chunk_data_iterators  # noqa: E402
from megatron_lite.errors import exit_with_message, run_script  # noqa: E402
from megatron_lite.training.loop import pretrain  # noqa: E402


class CountingDataset:
    """``num_samples`` sequences ``start, start + 1, ...`` (mod ``vocab_size``), ``start`` drawn per sample."""

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int):
        self.num_samples, self.seq_length, self.vocab_size, self.seed = num_samples, seq_length, vocab_size, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict:
        start = np.random.default_rng([self.seed, index]).integers(self.vocab_size)
        sequence = (start + np.arange(self.seq_length + 1)) % self.vocab_size
        return {"tokens": sequence[:-1].astype(np.int64), "labels": sequence[1:].astype(np.int64),
                "loss_mask": np.ones(self.seq_length, dtype=np.float32)}


def datasets_provider(config, state, consumed_train: int, consumed_valid: int):
    """(train, valid) iterators: the samples the run needs, from this script's dataset."""
    t, m = config.training, config.model
    train, valid, _ = train_valid_test_num_samples(t.train_iters, t.global_batch_size, t.eval_interval,
                                                   t.eval_iters, t.train_samples, t.valid_samples)
    train_ds = CountingDataset(train, m.seq_length, m.vocab_size, t.seed)
    valid_ds = CountingDataset(valid, m.seq_length, m.vocab_size, t.seed + 1) if valid else None
    return chunk_data_iterators(config, state, train_ds, valid_ds, consumed_train, consumed_valid,
                                len(pretrain_gpt.my_layer_ranges(config, state)))


def main(argv=None):
    config = parse_args(argv, description=__doc__.split("\n\n")[0], checks=pretrain_gpt.check_gpt_flags,
                        data_from_script=True)
    try:
        d = config.data  # this provider reads no data flag: one given is refused, not ignored
        given = [flag for flag, value in (("--data-path", d.data_path), ("--train-data-path", d.train_data_path),
                                          ("--mock-data", d.mock_data)) if value]
        if given:
            raise ConfigError(f"{given[0]}: this script trains on its own dataset (CountingDataset); drop it")
        pretrain_gpt.set_vocab(config, pretrain_gpt.build_tokenizer_for(config))
        return pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.forward_step, datasets_provider)
    except (ConfigError, DataConfigError) as err:
        exit_with_message(f"error: {err}", 2)


if __name__ == "__main__":
    run_script(main)
