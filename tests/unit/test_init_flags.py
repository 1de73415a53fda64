"""--init-method-xavier-uniform and --embedding-init-method-std (Megatron-LM's init flags), on the
one-process GPT: which weights each draws, from which distribution (the TP2 model's shards equal the
one-process weights exactly: tests/distributed/test_gpt_model.py, variant X)."""

import math

import pytest

from megatron_lite.parallel.state import ParallelState
from tests.cli_errors import parse_refused
from tests.model_helpers import build_gpt
from tests.unit.test_gpt_model import make_config

EMBEDDINGS = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")


def _weights(**flags):
    cfg = make_config("A", swiglu=True, untie_embeddings_and_output_weights=True, **flags)
    model = build_gpt(cfg, ParallelState(world_size=1, rank=0), seed=5)
    return {n: p.detach() for n, p in model.named_parameters() if p.dim() == 2}


def _is_xavier(w):
    bound = math.sqrt(6.0 / (w.shape[0] + w.shape[1]))  # (fan_out, fan_in) of the whole matrix
    return w.abs().max() <= bound and w.abs().max() > 0.9 * bound and abs(w.std() - bound / math.sqrt(3)) < 0.15 * bound


def test_xavier_draws_every_linear_weight_and_the_embeddings_from_their_own_bound():
    """No depth scaling of linear_proj / fc2; the untied output layer too; the embeddings as well
    while --embedding-init-method-std is not given another std (Megatron-LM's rule)."""
    weights = _weights(init_method_xavier_uniform=True)
    assert any("linear_fc2" in n for n in weights) and "output_layer.weight" in weights
    for name, w in weights.items():
        assert _is_xavier(w), name


def test_embedding_std_covers_the_embeddings_only():
    for flags in (dict(embedding_init_method_std=0.05), dict(embedding_init_method_std=0.05,
                                                            init_method_xavier_uniform=True)):
        weights = _weights(**flags)
        for name in EMBEDDINGS:
            assert weights[name].std() == pytest.approx(0.05, rel=0.1), (flags, name)
        others = {n: w for n, w in weights.items() if n not in EMBEDDINGS}
        if flags.get("init_method_xavier_uniform"):
            assert all(_is_xavier(w) for w in others.values())
        else:  # N(0, 0.02^2), the output projections 0.02 / sqrt(2 x layers); the untied output layer 0.02
            for name, w in others.items():
                scaled = "linear_fc2" in name or "linear_proj" in name
                assert w.std() == pytest.approx(0.02 / (2.0 if scaled else 1.0), rel=0.15), name
    plain, same = _weights(), _weights(embedding_init_method_std=0.02)  # the default std: the same draw
    assert all((plain[n] == same[n]).all() for n in plain)


def test_negative_embedding_std_is_refused(capsys):
    parse_refused(capsys, ["--mock-data", "--vocab-size", "64", "--embedding-init-method-std", "-1"],
                  "--embedding-init-method-std must be at least 0, got -1.0")
