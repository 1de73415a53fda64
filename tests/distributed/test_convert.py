"""tools/checkpoint/convert.py on checkpoints saved by real TP2 x PP2 runs (four gloo ranks).

Two models, the two branches of every model option: ``gpt2`` (learned positions, LayerNorm, GeLU,
biases, tied) and ``llama`` (RoPE, RMSNorm, SwiGLU, no biases, GQA with 4 of 8 heads, untied, saved
with two virtual pipeline chunks per rank). Every parameter, norms and biases included, is random
(not the ones/zeros of the init), so a swapped or misplaced tensor changes the logits.
Hugging Face comparisons are within fp32 rounding (rtol 1e-5, atol 1e-5); weights move bit-exactly.
"""

import os
import shlex

import pytest
import torch
import torch.distributed as dist

from megatron_lite.checkpoint import load_checkpoint, load_gpt_checkpoint, merge_checkpoint, save_checkpoint
from megatron_lite.config import Config, ModelConfig
from megatron_lite.models.common import param_seed
from megatron_lite.parallel.pipeline import layer_ranges
from megatron_lite.parallel.tensor import padded_vocab_size, shard, unshard
from tests.harness import cached_state, run_ranks
from tests.model_helpers import build_gpt
from tests.tools import load_tool

VOCAB = 100
VARIANTS = {
    "gpt2": dict(num_attention_heads=4),
    "llama": dict(num_attention_heads=8, group_query_attention=True, num_query_groups=4, position_embedding_type="rope",
                  rotary_base=5000, normalization="RMSNorm", swiglu=True, disable_bias_linear=True,
                  untie_embeddings_and_output_weights=True, norm_epsilon=1e-6),
}
VPP = {"gpt2": None, "llama": 1}  # layers per virtual stage
HF_ACT = {"gpt2": "gelu", "gpt2_tanh": "gelu_new"}


def model_config(variant, tp=1) -> ModelConfig:
    cfg = ModelConfig(num_layers=4, hidden_size=32, ffn_hidden_size=48, seq_length=16, max_position_embeddings=16,
                      vocab_size=VOCAB, make_vocab_size_divisible_by=8, attention_dropout=0.0, hidden_dropout=0.0,
                      **VARIANTS[variant])
    cfg.padded_vocab_size = padded_vocab_size(VOCAB, 8, tp)
    return cfg


def run_config(variant, tp, pp, vpp=None, root=None) -> Config:
    config = Config(model=model_config(variant, tp))
    config.fusion.bias_gelu_fusion = False  # the models here are built unfused (exact GeLU), not by the CLI
    p = config.parallel
    p.tensor_model_parallel_size, p.pipeline_model_parallel_size = tp, pp
    p.num_layers_per_virtual_pipeline_stage = vpp
    config.checkpoint.save = config.checkpoint.load = root
    config.checkpoint.no_load_optim = config.checkpoint.no_load_rng = True
    return config


def _global_name(name, start, tied):
    if name.startswith("decoder.layers."):
        i, rest = name[len("decoder.layers."):].split(".", 1)
        return f"decoder.layers.{start + int(i)}.{rest}"
    return "embedding.word_embeddings.weight" if name == "output_layer.weight" and tied else name


def randomize(model, state):
    """Replace every parameter by random values drawn for its *full* tensor (seeded by its global
    name), this rank taking its shard: the same model at any layout."""
    for name, p in model.named_parameters():
        full_shape = list(p.shape)
        if getattr(p, "tensor_model_parallel", False):
            full_shape[p.partition_dim] *= state.tp_size
        gen = torch.Generator().manual_seed(param_seed(99, 0, _global_name(name, model.layer_start, model.tied)))
        full = torch.randn(full_shape, generator=gen) * 0.3 + (1.0 if "norm" in name and name.endswith("weight") else 0)
        if getattr(p, "tensor_model_parallel", False):
            full = shard(full, p.partition_dim, state.tp_rank, state.tp_size, getattr(p, "partition_stride", 1))
        with torch.no_grad():
            p.copy_(full)


def build_chunks(variant, state, vpp):
    ranges = layer_ranges(4, state.pp_size, vpp)[state.pp_rank]
    return [build_gpt(model_config(variant, state.tp_size), state, seed=5,
                      pre_process=state.is_first_stage() and c == 0,
                      post_process=state.is_last_stage() and c == len(ranges) - 1, layer_start=s, layer_end=e).eval()
            for c, (s, e) in enumerate(ranges)]


def save_sources(root):
    for variant in VARIANTS:
        vpp = VPP[variant]
        state = cached_state(tp=2, pp=2, vpp=None if vpp is None else 2)
        chunks = build_chunks(variant, state, vpp)
        for chunk in chunks:
            randomize(chunk, state)
        save_checkpoint(7, chunks, None, None, 56, run_config(variant, 2, 2, vpp, os.path.join(root, variant)), state)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("sources"))
    run_ranks(4, save_sources, root)
    return {v: os.path.join(root, v) for v in VARIANTS}


def convert(*argv):
    """The command line in this process; returns its exit code."""
    return load_tool("checkpoint/convert").main(["--model-type", "GPT", *map(str, argv)])


TOKENS = torch.tensor([[5, 17, 42, 8, 61, 3, 99, 0, 12, 77, 31, 2], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]])


def reference_logits(root):
    model, _ = load_gpt_checkpoint(root)
    with torch.no_grad():
        return model(TOKENS)[..., :VOCAB]


def assert_same_weights(got: dict, want: dict, vocab_rows=VOCAB):
    """Bit-exact; vocabulary tensors on their real rows, padded rows zero in the converted one."""
    assert set(got) == set(want)
    for k, v in want.items():
        if k in ("embedding.word_embeddings.weight", "output_layer.weight"):
            assert torch.equal(got[k][:vocab_rows], v[:vocab_rows]), k
            assert not got[k][vocab_rows:].any(), k
        else:
            assert torch.equal(got[k], v), k


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tp2pp2_to_tp1_to_tp4_keeps_the_merged_weights(variant, sources, tmp_path):
    tp1, tp4 = tmp_path / "tp1", tmp_path / "tp4"
    assert convert("--load-dir", sources[variant], "--save-dir", tp1, "--target-tensor-parallel-size", 1,
                   "--target-pipeline-parallel-size", 1) == 0
    assert convert("--load-dir", tp1, "--save-dir", tp4, "--target-tensor-parallel-size", 4) == 0
    original, _ = merge_checkpoint(sources[variant])
    for out, tp in ((tp1, 1), (tp4, 4)):
        got, cfg = merge_checkpoint(str(out))
        assert (cfg["tensor_model_parallel_size"], cfg["pipeline_model_parallel_size"]) == (tp, 1)
        assert cfg["padded_vocab_size"] == padded_vocab_size(VOCAB, 8, tp)
        assert (cfg["iteration"], cfg["consumed_samples"]) == (7, 56)
        assert_same_weights(got, original)
    assert sorted(os.listdir(tp4 / "iter_0000007")) == [f"mp_rank_{t:02d}_000" for t in range(4)]


def tp4_logits(variant, root):
    """Load a TP4 checkpoint the way training does (strict, at its layout) and gather the logits."""
    state = cached_state(tp=4)
    chunks = build_chunks(variant, state, None)
    assert load_checkpoint(chunks, None, None, run_config(variant, 4, 1, None, root), state) == (7, 56)
    with torch.no_grad():
        shard_logits = chunks[0](TOKENS)
    parts = [torch.empty_like(shard_logits) for _ in range(4)]
    dist.all_gather(parts, shard_logits.contiguous(), group=state.tp_group)
    return unshard(parts, 2)[..., :VOCAB]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_converted_checkpoint_loads_at_the_new_layout_with_the_same_logits(variant, sources, tmp_path):
    out = str(tmp_path / "tp4")
    assert convert("--load-dir", sources[variant], "--save-dir", out, "--target-tensor-parallel-size", 4,
                   "--target-pipeline-parallel-size", 1) == 0
    logits = run_ranks(4, tp4_logits, variant, out)[0]
    torch.testing.assert_close(logits, reference_logits(sources[variant]), rtol=1e-5, atol=1e-5)  # TP sums: rounding


# ---------------------------------------------------------------------------------------------
# Hugging Face


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_hf_export_gives_the_same_logits_in_transformers(variant, sources, tmp_path):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    assert convert("--saver", "hf", "--load-dir", sources[variant], "--save-dir", out, "--max-shard-size", "40KB") == 0
    assert (out / "model.safetensors.index.json").is_file()  # small shards: the sharded layout
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(hf).__name__ == {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[variant]
    with torch.no_grad():
        logits = hf(TOKENS).logits
    torch.testing.assert_close(logits, reference_logits(sources[variant]), rtol=1e-5, atol=1e-5)
    # no tokenizer (token ids as text): the last id ends a document, and generate() stops there
    assert hf.config.bos_token_id == hf.config.eos_token_id == VOCAB - 1
    assert hf.generation_config.eos_token_id == VOCAB - 1


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_megatron_hf_megatron_round_trip_is_bit_exact(variant, sources, tmp_path):
    pytest.importorskip("safetensors")
    hf, back, direct = tmp_path / "hf", tmp_path / "back", tmp_path / "direct"
    assert convert("--saver", "hf", "--load-dir", sources[variant], "--save-dir", hf) == 0
    assert convert("--loader", "hf", "--load-dir", hf, "--save-dir", back, "--target-tensor-parallel-size", 2,
                   "--target-pipeline-parallel-size", 2, "--make-vocab-size-divisible-by", 8) == 0
    assert convert("--load-dir", sources[variant], "--save-dir", direct, "--target-pipeline-parallel-size", 2) == 0
    got, cfg = merge_checkpoint(str(back))
    assert cfg["iteration"] == 0 and (back / "latest_checkpointed_iteration.txt").read_text().strip() == "release"
    assert_same_weights(got, merge_checkpoint(sources[variant])[0])
    for t in range(2):  # the very files equal a direct megatron -> megatron conversion at that layout
        for p in range(2):
            a = torch.load(back / "release" / f"mp_rank_{t:02d}_{p:03d}" / "model_optim_rng.pt", weights_only=True)
            b = torch.load(direct / "iter_0000007" / f"mp_rank_{t:02d}_{p:03d}" / "model_optim_rng.pt", weights_only=True)
            for chunk_a, chunk_b in zip(a["model"], b["model"], strict=True):
                assert chunk_a.keys() == chunk_b.keys()
                assert all(torch.equal(chunk_a[k], chunk_b[k]) for k in chunk_a)


def _random_hf_model(variant, transformers):
    torch.manual_seed(3)
    if variant in HF_ACT:
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=4, n_head=4, n_inner=48,
                                      activation_function=HF_ACT[variant], resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                       num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=16,
                                       rope_theta=5000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model.eval()


@pytest.mark.parametrize("variant", ["gpt2", "gpt2_tanh", "llama"])
def test_hf_import_to_tp2_pp2_gives_the_same_logits(variant, tmp_path):
    transformers = pytest.importorskip("transformers")
    model = _random_hf_model(variant, transformers)
    model.save_pretrained(str(tmp_path / "hf"))
    (tmp_path / "hf" / "tokenizer.json").write_text("{}")
    out = tmp_path / "mega"
    assert convert("--loader", "hf", "--load-dir", tmp_path / "hf", "--save-dir", out,
                   "--target-tensor-parallel-size", 2, "--target-pipeline-parallel-size", 2,
                   "--make-vocab-size-divisible-by", 8) == 0
    assert sorted(os.listdir(out / "release")) == [f"mp_rank_{t:02d}_{p:03d}" for t in range(2) for p in range(2)]
    assert (out / "tokenizer" / "tokenizer.json").read_text() == "{}"
    ours, saved = load_gpt_checkpoint(str(out))
    assert saved["padded_vocab_size"] == padded_vocab_size(VOCAB, 8, 2)
    assert saved["openai_gelu"] == (variant == "gpt2_tanh")
    with torch.no_grad():
        expected = model(TOKENS).logits
        torch.testing.assert_close(ours(TOKENS)[..., :VOCAB], expected, rtol=1e-5, atol=1e-5)
    # and back to Hugging Face from TP2 x PP2: the same model again, tokenizer file included
    assert convert("--saver", "hf", "--load-dir", out, "--save-dir", tmp_path / "again") == 0
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "again")).eval()
    assert (tmp_path / "again" / "tokenizer.json").read_text() == "{}"
    assert again.config.to_dict()["activation_function" if variant != "llama" else "hidden_act"] == \
        model.config.to_dict()["activation_function" if variant != "llama" else "hidden_act"]
    with torch.no_grad():
        torch.testing.assert_close(again(TOKENS).logits, expected, rtol=1e-5, atol=1e-5)


def _word_tokenizer(path):
    """A tokenizer.json of VOCAB whole words (w0 ... w98, then the end of document)."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(VOCAB - 1)} | {"<|endoftext|>": VOCAB - 1}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))


def test_generate_uses_the_tokenizer_an_hf_import_kept(tmp_path, capsys):
    """After an HF import, tools/generate.py needs no tokenizer flag (it reads <save>/tokenizer), and
    the converter prints the flags that load those files for training."""
    transformers = pytest.importorskip("transformers")
    _random_hf_model("gpt2", transformers).save_pretrained(str(tmp_path / "hf"))
    _word_tokenizer(tmp_path / "hf" / "tokenizer.json")
    out = tmp_path / "mega"
    assert convert("--loader", "hf", "--load-dir", tmp_path / "hf", "--save-dir", out,
                   "--make-vocab-size-divisible-by", 8) == 0
    kept = str(out / "tokenizer" / "tokenizer.json")
    assert f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {kept}" in capsys.readouterr().out
    assert load_tool("generate").main(["--load", str(out), "--prompt", "w5 w17 w42", "--max-new-tokens", "3",
                                       "--greedy"]) == 0
    printed = capsys.readouterr().out.split()
    assert printed[:3] == ["w5", "w17", "w42"] and len(printed) > 3


def test_hf_refusals_name_the_option(sources, tmp_path, capsys):
    pytest.importorskip("safetensors")
    cases = [
        (["--saver", "hf", "--hf-style", "gpt2", "--load-dir", sources["llama"]], "--position-embedding-type rope"),
        (["--saver", "hf", "--hf-style", "llama", "--load-dir", sources["gpt2"]], "--position-embedding-type"),
        (["--saver", "hf", "--target-tensor-parallel-size", "2", "--load-dir", sources["gpt2"]],
         "--target-tensor-parallel-size"),
        (["--load-dir", sources["llama"], "--target-tensor-parallel-size", "8"], "num-query-groups 4"),
        (["--load-dir", sources["gpt2"], "--target-expert-parallel-size", "2"], "--target-expert-parallel-size"),
        (["--load-dir", sources["gpt2"], "--hf-style", "gpt2"], "--hf-style"),
        (["--load-dir", sources["gpt2"], "--model-type", "BERT"], "--model-type BERT"),
    ]
    for i, (argv, words) in enumerate(cases):
        assert convert(*argv, "--save-dir", tmp_path / f"out{i}") == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err, err
    assert not any(os.listdir(tmp_path / f"out{i}") for i in range(len(cases)) if (tmp_path / f"out{i}").exists())


def test_hf_import_refuses_an_activation_it_cannot_express(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=1, n_head=4,
                                  activation_function="relu")
    transformers.GPT2LMHeadModel(cfg).save_pretrained(str(tmp_path / "hf"))
    capsys.readouterr()  # transformers' own progress output
    assert convert("--loader", "hf", "--load-dir", tmp_path / "hf", "--save-dir", tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "activation_function 'relu'" in err, err
    assert not (tmp_path / "out").exists()



@pytest.mark.parametrize("variant", list(VARIANTS))
def test_printed_flags_describe_the_converted_model(variant, sources, tmp_path, capsys):
    from megatron_lite.arguments import parse_args
    from megatron_lite.checkpoint.arch import arch_differences
    from megatron_lite.checkpoint.format import ARCH_FIELDS

    out = tmp_path / "tp4"
    assert convert("--load-dir", sources[variant], "--save-dir", out, "--target-tensor-parallel-size", 4,
                   "--target-pipeline-parallel-size", 1) == 0
    line = capsys.readouterr().out.split("load it with: ")[1].split(" (and the tokenizer flags)")[0]
    flags = shlex.split(line)
    assert flags[:2] == ["--load", str(out)] and flags[-2:] == ["--no-load-optim", "--no-load-rng"]
    config = parse_args(flags + ["--mock-data", "--vocab-size", str(VOCAB)], world_size=4)
    saved = merge_checkpoint(str(out))[1]
    # (a derived flag saved unset is compared through its sources; absent: another script's field)
    assert not arch_differences(saved, config, tuple(k for k in ARCH_FIELDS if k != "padded_vocab_size"))
    assert config.parallel.tensor_model_parallel_size == 4


def _payload(root, iteration, t, p):
    return torch.load(os.path.join(root, iteration, f"mp_rank_{t:02d}_{p:03d}", "model_optim_rng.pt"), weights_only=True)


def test_interleaved_and_uneven_layouts_are_written_as_training_writes_them(sources, tmp_path):
    """llama was saved by training at TP2 x PP2 with two virtual chunks per rank. Converting it with no
    target options keeps that layout; TP1 and back to it with --target-num-layers-per-virtual-pipeline-stage
    gives files equal to training's own (chunk layer ranges, partition meta, every real weight)."""
    same, tp1, back, uneven = (tmp_path / n for n in ("same", "tp1", "back", "uneven"))
    assert convert("--load-dir", sources["llama"], "--save-dir", same) == 0
    assert convert("--load-dir", sources["llama"], "--save-dir", tp1, "--target-tensor-parallel-size", 1,
                   "--target-pipeline-parallel-size", 1) == 0
    assert convert("--load-dir", tp1, "--save-dir", back, "--target-tensor-parallel-size", 2,
                   "--target-pipeline-parallel-size", 2, "--target-num-layers-per-virtual-pipeline-stage", 1) == 0
    for out in (same, back):
        for t in range(2):
            for p in range(2):
                want, got = _payload(sources["llama"], "iter_0000007", t, p), _payload(str(out), "iter_0000007", t, p)
                for key in ("tp_size", "pp_size", "vpp_size", "num_chunks", "param_meta"):
                    assert got[key] == want[key], key
                assert [tuple(r) for r in got["layer_ranges"]] == [tuple(r) for r in want["layer_ranges"]]
                for chunk_got, chunk_want in zip(got["model"], want["model"], strict=True):
                    assert chunk_got.keys() == chunk_want.keys()
                    for k, v in chunk_want.items():
                        rows = None  # vocabulary shards: this TP rank's real rows only
                        if "word_embeddings" in k or "output_layer" in k:
                            rows = max(0, min(v.shape[0], VOCAB - t * v.shape[0]))
                        assert torch.equal(chunk_got[k][:rows], v[:rows]), k
    assert convert("--load-dir", tp1, "--save-dir", uneven, "--target-pipeline-parallel-size", 2,
                   "--target-decoder-first-pipeline-num-layers", 1) == 0
    assert [tuple(r) for r in _payload(str(uneven), "iter_0000007", 0, 1)["layer_ranges"]] == [(1, 4)]
    assert_same_weights(merge_checkpoint(str(uneven))[0], merge_checkpoint(sources["llama"])[0])
