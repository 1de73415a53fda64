"""``python bad_batch_on_one_rank.py RANK ITERATION ARGS...``: pretrain_gpt.py whose global rank
RANK finds a token id beyond the vocabulary in the batch it draws at ITERATION (the others' data is
fine), as when one data-parallel rank reads a corrupt sample. The real check refuses it."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository root

import pretrain_gpt  # noqa: E402
from megatron_lite.errors import run_script


def corrupting(bad_rank: int, bad_batch: int):
    real = pretrain_gpt.checked_token_ids

    def checked(batches, vocab_size, data_path):
        def batches_with_one_bad():
            for i, batch in enumerate(batches, 1):
                if i == bad_batch and int(os.environ.get("RANK", "0")) == bad_rank:
                    batch = dict(batch, tokens=batch["tokens"].clone())
                    batch["tokens"][0, 0] = vocab_size
                yield batch
        return real(batches_with_one_bad(), vocab_size, data_path)

    return checked


if __name__ == "__main__":
    pretrain_gpt.checked_token_ids = corrupting(int(sys.argv[1]), int(sys.argv[2]))
    run_script(lambda: pretrain_gpt.main(sys.argv[3:]))
