"""--max-position-embeddings (default: --seq-length) sizes the learned position table only. A rotary
model has no such table, so a fine-tune or a resume at a longer --seq-length than the checkpoint's (a
model pretrained at 64 tokens, fine-tuned at 128) must load; it used to be refused as
"saved with max-position-embeddings 64 (this run 128); match the model flags" by every kind of load.
With learned positions the table's rows differ and the refusal stays (Megatron-LM compares the flag
only with learned positions too)."""

from types import SimpleNamespace

import pytest

from megatron_lite.checkpoint import CheckpointError
from megatron_lite.checkpoint.arch import check_architecture
from megatron_lite.config import Config


def _flat(position: str, seq: int) -> dict:
    return {**Config().flat(), "position_embedding_type": position, "seq_length": seq, "max_position_embeddings": seq}


def _run(flat: dict):
    return SimpleNamespace(flat=lambda: dict(flat))


@pytest.mark.parametrize("load", ["resume", "release", "weights"])
def test_a_rotary_model_loads_at_another_sequence_length(load):
    check_architecture("ck", _flat("rope", 64), _run(_flat("rope", 128)), load)


@pytest.mark.parametrize("load", ["resume", "release", "weights"])
@pytest.mark.parametrize("saved, ours", [("learned_absolute", "learned_absolute"), ("rope", "learned_absolute"),
                                         ("learned_absolute", "rope")])
def test_a_learned_position_table_of_another_size_is_refused(load, saved, ours):
    with pytest.raises(CheckpointError, match="--max-position-embeddings 64 \\(this run 128\\).*; load it with --max-position-embeddings 64"):
        check_architecture("ck", _flat(saved, 64), _run(_flat(ours, 128)), load)
