"""--apply-layernorm-1p (Megatron-LM's zero-centred norm weights: LayerNorm/RMSNorm scale by 1 + w, w
starting at 0): the model equals the plain-norm model holding 1 + w (against the independent reference
of test_gpt_model.py, fp32 rtol 1e-5); Hugging Face export writes 1 + w (transformers' logits equal
ours within 1e-5) and the hf loader's --apply-layernorm-1p stores w - 1. TP2 + SP: tests/distributed
(variant N); cached decoding: tests/unit/test_inference_engine.py (norm_1p)."""

import dataclasses

import pytest
import torch

from megatron_lite.checkpoint import load_gpt_checkpoint, merge_checkpoint
from megatron_lite.models.common import Norm
from megatron_lite.parallel.state import ParallelState
from tests.convert_helpers import convert
from tests.inference_helpers import VOCAB, save_model
from tests.model_helpers import build_gpt
from tests.unit.test_gpt_model import _close, make_batch, make_config, reference_logits

TOKENS = torch.tensor([[5, 17, 42, 8, 61, 3, 99, 0, 12, 77, 31, 2], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]])


def _norm_names(model):
    return [f"{n}.weight" for n, m in model.named_modules() if isinstance(m, Norm)]


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_zero_centred_norms_equal_plain_norms_holding_one_plus_w(normalization):
    cfg = make_config("N", normalization=normalization)
    model = build_gpt(cfg, ParallelState(), seed=7)
    names = _norm_names(model)
    assert len(names) == 2 * cfg.num_layers + 1
    assert all(not model.get_parameter(n).any() for n in names)  # initialised to 0: the plain norm's 1
    plain = build_gpt(dataclasses.replace(cfg, apply_layernorm_1p=False), ParallelState(), seed=7)
    tokens, _ = make_batch()
    assert torch.equal(model(tokens), plain(tokens))
    with torch.no_grad():
        for n in names:
            model.get_parameter(n).normal_(0, 0.3, generator=torch.Generator().manual_seed(len(n)))
    sd = {k: v.detach() + (1 if k in names else 0) for k, v in model.state_dict().items()}
    _close(model(tokens), reference_logits(sd, dataclasses.replace(cfg, apply_layernorm_1p=False), tokens), "logits")


def test_hugging_face_export_adds_one_and_the_import_option_subtracts_it(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    ours = save_model("norm_1p", str(tmp_path / "mega"))  # llama-style, random norm weights
    with torch.no_grad():
        expected = ours(TOKENS)[..., :VOCAB]
    assert convert("GPT", "--saver", "hf", "--load-dir", tmp_path / "mega", "--save-dir", tmp_path / "hf") == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(TOKENS).logits, expected, rtol=1e-5, atol=1e-5)
    source = merge_checkpoint(str(tmp_path / "mega"))[0]
    # imported with the option: a --apply-layernorm-1p model again, its norm weights (1 + w) - 1
    assert convert("GPT", "--loader", "hf", "--load-dir", tmp_path / "hf", "--save-dir", tmp_path / "back",
                   "--apply-layernorm-1p", "--make-vocab-size-divisible-by", 8) == 0
    assert "--apply-layernorm-1p" in capsys.readouterr().out  # in the printed flags that load it
    back, saved = load_gpt_checkpoint(str(tmp_path / "back"))
    assert saved["apply_layernorm_1p"]
    got = merge_checkpoint(str(tmp_path / "back"))[0]
    for name in _norm_names(back):
        torch.testing.assert_close(got[name], source[name], rtol=0, atol=1e-6)  # one rounding of w + 1
    with torch.no_grad():
        torch.testing.assert_close(back(TOKENS)[..., :VOCAB], expected, rtol=1e-5, atol=1e-5)
    # without it: a plain-norm model computing the same function
    assert convert("GPT", "--loader", "hf", "--load-dir", tmp_path / "hf", "--save-dir", tmp_path / "plain") == 0
    plain, saved = load_gpt_checkpoint(str(tmp_path / "plain"))
    assert not saved["apply_layernorm_1p"]
    with torch.no_grad():
        torch.testing.assert_close(plain(TOKENS)[..., :VOCAB], expected, rtol=1e-5, atol=1e-5)


def test_the_import_option_is_refused_by_the_megatron_loader(tmp_path, capsys):
    save_model("norm_1p", str(tmp_path / "mega"))
    assert convert("GPT", "--load-dir", tmp_path / "mega", "--save-dir", tmp_path / "out", "--apply-layernorm-1p") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--apply-layernorm-1p applies to --loader hf only" in err, err
