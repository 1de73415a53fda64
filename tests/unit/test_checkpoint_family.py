"""A BERT checkpoint given to a GPT run (or the reverse) is refused in one line that names both
families and the script to use. The models share no tensor name (BERT's ``encoder``, GPT's
``decoder``), so the load used to fail on a list of missing tensors (torch resume: "does not match
the model: missing in checkpoint: embedding.tokentype_embeddings.weight, ..."; --pretrained-checkpoint
and torch_dist: "does not fit the model: ...") that did not say why."""

from types import SimpleNamespace

import pytest

from megatron_lite.checkpoint import CheckpointError
from megatron_lite.checkpoint.arch import check_architecture, check_family
from megatron_lite.checkpoint.compat import check_compatible
from megatron_lite.config import Config

GPT = Config().flat()
BERT = {**GPT, "bert_no_binary_head": False, "mask_prob": 0.15, "short_seq_prob": 0.1, "bert_load": None}


def _run(flat: dict):
    return SimpleNamespace(flat=lambda: dict(flat))


@pytest.mark.parametrize("saved, ours, words", [
    (BERT, GPT, ["ck holds a BERT model (pretrain_bert.py), this run trains a GPT (pretrain_gpt.py)",
                 "load it with pretrain_bert.py, or give a GPT checkpoint"]),
    (GPT, BERT, ["ck holds a GPT model (pretrain_gpt.py), this run trains a BERT (pretrain_bert.py)",
                 "load it with pretrain_gpt.py, or give a BERT checkpoint"]),
])
@pytest.mark.parametrize("load", ["resume", "release", "weights"])
def test_the_other_family_is_named_by_every_kind_of_load(saved, ours, words, load):
    with pytest.raises(CheckpointError) as err:
        check_architecture("ck", saved, _run(ours), load)
    for w in words:
        assert w in str(err.value), err.value


def test_a_torch_resume_names_the_family_before_comparing_tensors():
    """check_compatible (a --ckpt-format torch resume) checks the family before sizes and tensors."""
    with pytest.raises(CheckpointError, match="holds a BERT model .* this run trains a GPT"):
        check_compatible("ck/iter_0000001/mp_rank_00/model_optim_rng.pt", {"config": BERT, "model": [{}]}, [],
                         _run(GPT), state=None)


@pytest.mark.parametrize("flat", [GPT, BERT])
def test_the_same_family_and_a_file_without_flags_pass(flat):
    check_family("ck", flat, _run(flat))
    check_family("ck", {}, _run(flat))  # no saved flags: the tensor comparison speaks
    check_architecture("ck", flat, _run(flat))
