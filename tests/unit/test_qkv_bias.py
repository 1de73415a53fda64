"""--add-qkv-bias (Megatron-LM's: a bias on the QKV projection only, with --disable-bias-linear; Qwen2's
attention): the model against the independent reference of test_gpt_model.py with a random bias, the
converter at TP2 (grouped-query attention: each rank holds whole key/value groups) and Hugging Face
``qwen2`` import/export against ``transformers`` (fp32 rtol/atol 1e-5), and the refusals."""

import json

import pytest
import torch

from megatron_lite.arguments import parse_args
from megatron_lite.checkpoint import load_gpt_checkpoint, merge_checkpoint
from megatron_lite.parallel.state import ParallelState
from tests.cli_errors import parse_refused
from tests.convert_helpers import convert
from tests.model_helpers import build_gpt
from tests.unit.test_gpt_model import _close, make_batch, make_config, reference_logits

VOCAB = 100
TOKENS = torch.tensor([[5, 17, 42, 8, 61, 3, 99, 0, 12, 77, 31, 2], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]])


def test_qkv_bias_alone_matches_the_reference():
    cfg = make_config("B", add_qkv_bias=True)  # no other bias (variant B: --disable-bias-linear), GQA 8 heads / 4 groups
    model = build_gpt(cfg, ParallelState(), seed=7)
    biases = sorted(n for n, _ in model.named_parameters() if n.endswith("bias"))
    assert biases == [f"decoder.layers.{i}.self_attention.linear_qkv.bias" for i in range(cfg.num_layers)]
    with torch.no_grad():
        for name in biases:
            model.get_parameter(name).normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    tokens, _ = make_batch()
    _close(model(tokens), reference_logits(sd, cfg, tokens), "logits")


def _random_qwen2(transformers, tied=False):
    torch.manual_seed(3)
    cfg = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=16,
                                   rope_theta=5000.0, rms_norm_eps=1e-6, tie_word_embeddings=tied)
    model = transformers.Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model.eval()


@pytest.mark.parametrize("tied", [False, True])
def test_qwen2_import_at_tp2_and_export_give_the_same_logits(tied, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    model = _random_qwen2(transformers, tied)
    model.save_pretrained(str(tmp_path / "hf"))
    out = tmp_path / "mega"
    assert convert("GPT", "--loader", "hf", "--load-dir", tmp_path / "hf", "--save-dir", out,
                   "--target-tensor-parallel-size", 2, "--make-vocab-size-divisible-by", 8) == 0
    ours, saved = load_gpt_checkpoint(str(out))  # merged from the two TP shards
    assert saved["add_qkv_bias"] and saved["disable_bias_linear"]
    with torch.no_grad():
        expected = model(TOKENS).logits
        torch.testing.assert_close(ours(TOKENS)[..., :VOCAB], expected, rtol=1e-5, atol=1e-5)
    # each TP shard holds whole groups: rank 1's bias is groups 2-3 of the fused [groups, (r + 2) * d] layout
    shard = torch.load(out / "release" / "mp_rank_01_000" / "model_optim_rng.pt", weights_only=True)["model"]
    shard = shard[0] if isinstance(shard, list) else shard
    full = merge_checkpoint(str(out))[0]["decoder.layers.0.self_attention.linear_qkv.bias"]
    assert torch.equal(shard["decoder.layers.0.self_attention.linear_qkv.bias"], full.chunk(2)[1])
    assert convert("GPT", "--saver", "hf", "--hf-style", "llama", "--load-dir", out, "--save-dir", tmp_path / "x") == 2
    assert "use --hf-style qwen2" in capsys.readouterr().err
    assert convert("GPT", "--saver", "hf", "--load-dir", out, "--save-dir", tmp_path / "again") == 0
    written = json.loads((tmp_path / "again" / "config.json").read_text())
    assert written["model_type"] == "qwen2" and written["architectures"] == ["Qwen2ForCausalLM"]
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "again")).eval()
    assert type(again).__name__ == "Qwen2ForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(again(TOKENS).logits, expected, rtol=1e-5, atol=1e-5)
    # and back again: megatron -> hf -> megatron is bit-exact
    assert convert("GPT", "--loader", "hf", "--load-dir", tmp_path / "again", "--save-dir", tmp_path / "back",
                   "--make-vocab-size-divisible-by", 8) == 0
    got, want = merge_checkpoint(str(tmp_path / "back"))[0], merge_checkpoint(str(out))[0]
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k][: v.shape[0]] if "word_embeddings" in k or "output_layer" in k else got[k],
                           v[: got[k].shape[0]] if "word_embeddings" in k or "output_layer" in k else v), k


BASE = ["--mock-data", "--vocab-size", "64", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear"]


def test_flag_parses_and_multi_latent_attention_refuses_it(capsys):
    assert parse_args(BASE + ["--add-qkv-bias"], world_size=1).model.add_qkv_bias
    assert not parse_args(BASE, world_size=1).model.add_qkv_bias  # Megatron's default: off
    parse_refused(capsys, BASE + ["--add-qkv-bias", "--multi-latent-attention"], "--add-qkv-bias",
                  "--multi-latent-attention", world_size=1)
