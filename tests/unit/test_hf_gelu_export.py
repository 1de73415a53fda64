"""Hugging Face export of a GeLU MLP trained with Megatron's default flags, whose fused bias + GeLU
(--bias-gelu-fusion, on by default) is the tanh approximation.

GPT: the gpt2 format writes ``activation_function: "gelu_new"`` (the tanh form, no --openai-gelu needed);
transformers' logits equal those of the checkpoint as served (1e-5); the import of "gelu_new" as the
tanh GeLU: tests/distributed/test_convert.py (gpt2_tanh). BERT: megatron-bert has one ``hidden_act`` for the MLP and the LM head, whose GeLU is exact here
(Megatron-Core's BertLMHead); "gelu_pytorch_tanh" would give the encoder and the sentence-order logits
but move the masked-LM logits by about 1e-3 (measured), so a default-flag BERT is refused in one line naming
--bias-gelu-fusion and the head, exit 2, nothing written. A --no-bias-gelu-fusion BERT exports exactly:
tests/distributed/test_convert_bert.py.
"""

import pytest
import torch

from megatron_lite.checkpoint import save_checkpoint
from megatron_lite.config import Config, ModelConfig
from megatron_lite.inference.loading import load_model
from megatron_lite.models import BertModel, TransformerConfig
from megatron_lite.parallel.state import ParallelState
from tests.convert_helpers import convert
from tests.inference_helpers import VOCAB, save_model

TOKENS = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))


def test_default_flag_gpt_exports_its_tanh_gelu_exactly(tmp_path):
    transformers = pytest.importorskip("transformers")
    save_model("gpt", str(tmp_path / "mega"))  # the run's flags: --bias-gelu-fusion (default), no --openai-gelu
    served, saved = load_model(str(tmp_path / "mega"))
    assert saved["bias_gelu_fusion"] and not saved["openai_gelu"]
    with torch.no_grad():
        expected = served(TOKENS)[..., :VOCAB]
    assert convert("GPT", "--saver", "hf", "--load-dir", tmp_path / "mega", "--save-dir", tmp_path / "hf") == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert hf.config.activation_function == "gelu_new"
    with torch.no_grad():
        torch.testing.assert_close(hf(TOKENS).logits, expected, rtol=1e-5, atol=1e-5)


def test_default_flag_bert_export_is_refused_in_one_line(tmp_path, capsys):
    from pretrain_bert import BertConfig

    model = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, seq_length=16,
                        max_position_embeddings=16, vocab_size=VOCAB, make_vocab_size_divisible_by=4)
    model.padded_vocab_size = VOCAB
    run = Config(model=model, extra_sections=("bert",))
    run.bert, run.checkpoint.save = BertConfig(), str(tmp_path / "src")
    assert run.fusion.bias_gelu_fusion  # Megatron's default
    state = ParallelState()
    save_checkpoint(1, [BertModel(TransformerConfig.from_model(model), state).eval()], None, None, 1, run, state)
    capsys.readouterr()
    assert convert("BERT", "--saver", "hf", "--load-dir", tmp_path / "src", "--save-dir", tmp_path / "hf") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--bias-gelu-fusion" in err and "LM head" in err and "--no-bias-gelu-fusion" in err
    assert not (tmp_path / "hf").exists()
