"""tools/checkpoint/convert.py on mixture-of-experts checkpoints saved by real EP2 x TP2 runs (four
gloo ranks, sequence parallel, one file per TP x EP rank, with the state of one Adam step), and the
Hugging Face Mixtral style.

Two models: ``mixtral`` (sequential experts split over TP, RoPE, RMSNorm, SwiGLU, no biases, GQA,
untied, every layer MoE: what Mixtral expresses) and ``grouped`` (grouped-GEMM expert weights whole
on every TP rank with ``--expert-tensor-parallel-size 1``, biases, shared experts, a sigmoid router
with expert bias, every other layer dense). Every tensor, expert bias included, is random. Weights
and optimizer state move bit-exactly; logits at another layout or in transformers agree within fp32
rounding (rtol/atol 1e-5), with deterministic routing (fp32, eval: no jitter, no capacity).
"""

import dataclasses
import os
import shlex

import pytest
import torch
import torch.nn.functional as F

from megatron_lite.checkpoint import load_checkpoint, load_gpt_checkpoint, merge_checkpoint, save_checkpoint
from megatron_lite.checkpoint.hf_mixtral import check_mixtral
from megatron_lite.config import Config, ModelConfig
from megatron_lite.errors import ConfigError
from megatron_lite.fusions.config import fusion_fields
from megatron_lite.models import GPTModel, TransformerConfig
from megatron_lite.moe.config import MoEConfig, moe_fields
from megatron_lite.optim import build_optimizer
from megatron_lite.parallel.data_parallel import DistributedDataParallel, finalize_model_grads
from megatron_lite.parallel.tensor import padded_vocab_size
from tests.convert_helpers import assert_same_weights, convert, randomize, same_optimizer
from tests.harness import cached_state, run_ranks

VOCAB = 100
MODELS = {
    "mixtral": (dict(num_attention_heads=8, group_query_attention=True, num_query_groups=4, position_embedding_type="rope",
                     rotary_base=5000, normalization="RMSNorm", swiglu=True, disable_bias_linear=True,
                     untie_embeddings_and_output_weights=True, norm_epsilon=1e-6),
                dict(num_experts=4, moe_ffn_hidden_size=16, moe_router_topk=2, moe_token_dispatcher_type="alltoall")),
    "grouped": (dict(num_attention_heads=4),
                dict(num_experts=4, moe_ffn_hidden_size=16, moe_router_topk=2, moe_grouped_gemm=True,
                     moe_layer_freq="([1,0]*2)", moe_shared_expert_intermediate_size=32,
                     moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                     moe_token_dispatcher_type="alltoall", expert_tensor_parallel_size=1)),
}
TOKENS = torch.tensor([[5, 17, 42, 8, 61, 3, 99, 0, 12, 77, 31, 2], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]])


def configs(variant, tp=1, ep=1, etp=None):
    model, moe = MODELS[variant]
    moe = moe if etp is None else {**moe, "expert_tensor_parallel_size": etp}
    cfg = ModelConfig(num_layers=4, hidden_size=32, ffn_hidden_size=48, seq_length=16, max_position_embeddings=16,
                      vocab_size=VOCAB, make_vocab_size_divisible_by=8, attention_dropout=0.0, hidden_dropout=0.0, **model)
    cfg.padded_vocab_size = padded_vocab_size(VOCAB, 8, tp)
    config = Config(model=cfg, moe=MoEConfig(**moe))
    p = config.parallel
    p.tensor_model_parallel_size, p.expert_model_parallel_size, p.sequence_parallel = tp, ep, tp > 1
    config.checkpoint.no_load_optim = config.checkpoint.no_load_rng = True
    return config


def build(variant, state):
    config = configs(variant, state.tp_size, state.ep_size, state.etp_size if state.folded else None)
    tc = TransformerConfig.from_model(config.model, tensor_model_parallel_size=state.tp_size,
                                      sequence_parallel=state.tp_size > 1, expert_model_parallel_size=state.ep_size,
                                      **moe_fields(config.moe), **fusion_fields(config.fusion, config.model.swiglu))
    return GPTModel(tc, state).eval(), config


def trained_optimizer(model, config, state):
    """One Adam step on this rank's own data (gradients reduced as in training): real moments and masters."""
    config.optim.lr = 1e-2
    ddp = DistributedDataParallel(model.train(), state)
    optimizer = build_optimizer(config, [ddp], state)
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(state.dp_rank))
    optimizer.scale_loss(ddp(tokens, labels=tokens.roll(-1, dims=1)).mean()).backward()
    finalize_model_grads([ddp], state)
    assert optimizer.step()[0]
    model.eval()
    return optimizer


# parallel folding: the experts split over ETP 2 x EP 2 under TP 1 attention; whole experts over
# EP 4 under TP 2 attention (folded because EP 4 does not divide DP 2)
FOLDED = {"mixtral": dict(tp=1, ep=2, etp=2), "grouped": dict(tp=2, ep=4, etp=1)}


def save_sources(root):
    for variant in MODELS:
        for name, sizes in ((variant, dict(tp=2, ep=2)), (f"{variant}_folded", FOLDED[variant])):
            state = cached_state(**sizes)
            model, config = build(variant, state)
            randomize(model, state)
            optimizer = trained_optimizer(model, config, state)
            config.checkpoint.save = os.path.join(root, name)
            save_checkpoint(7, [model], optimizer, None, 56, config, state)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("moe_sources"))
    run_ranks(4, save_sources, root)
    os.makedirs(os.path.join(root, "mixtral", "tokenizer"))
    with open(os.path.join(root, "mixtral", "tokenizer", "tokenizer.json"), "w") as f:
        f.write('{"kept": true}')
    return {v: os.path.join(root, v) for v in MODELS} | {f"{v}_folded": os.path.join(root, f"{v}_folded") for v in MODELS}


def reference(root):
    model, _ = load_gpt_checkpoint(root)
    with torch.no_grad():
        return model(TOKENS)[..., :VOCAB]


def ep4_logits(variant, root):
    """Load an EP4 checkpoint as training does (strict, at its layout); every rank feeds the same tokens."""
    state = cached_state(ep=4)
    model, config = build(variant, state)
    config.checkpoint.load = root
    assert load_checkpoint([model], None, None, config, state) == (7, 56)  # (--no-load-optim)
    with torch.no_grad():
        return model(TOKENS)[..., :VOCAB]


def _files(root, iteration):
    folder = os.path.join(root, iteration)
    return {name: torch.load(os.path.join(folder, name, "model_optim_rng.pt"), weights_only=True)
            for name in sorted(os.listdir(folder)) if name.startswith("mp_rank_")}


@pytest.mark.parametrize("variant", list(MODELS))
def test_ep2_tp2_to_ep1_to_ep4_and_back_keeps_every_weight(variant, sources, tmp_path):
    ep1, ep4, back = tmp_path / "ep1", tmp_path / "ep4", tmp_path / "back"
    assert convert("GPT", "--load-dir", sources[variant], "--save-dir", ep1, "--target-tensor-parallel-size", 1,
                   "--target-expert-parallel-size", 1) == 0
    assert convert("GPT", "--load-dir", ep1, "--save-dir", ep4, "--target-expert-parallel-size", 4) == 0
    assert convert("GPT", "--load-dir", ep1, "--save-dir", back, "--target-tensor-parallel-size", 2,
                   "--target-expert-parallel-size", 2) == 0
    pp2 = tmp_path / "ep2pp2"  # experts with pipeline stages: chunk-local layers, EP-local experts
    assert convert("GPT", "--load-dir", ep1, "--save-dir", pp2, "--target-pipeline-parallel-size", 2,
                   "--target-expert-parallel-size", 2) == 0
    original, _ = merge_checkpoint(sources[variant])
    for out, (tp, ep) in ((ep1, (1, 1)), (ep4, (1, 4)), (back, (2, 2)), (pp2, (1, 2))):
        got, cfg = merge_checkpoint(str(out))
        assert (cfg["tensor_model_parallel_size"], cfg["expert_model_parallel_size"]) == (tp, ep)
        assert cfg["sequence_parallel"] == (tp > 1)
        assert_same_weights(got, original, VOCAB)
    assert sorted(os.listdir(ep4 / "iter_0000007")) == [f"mp_rank_00_000_{e:03d}" for e in range(4)]
    want, got = _files(sources[variant], "iter_0000007"), _files(str(back), "iter_0000007")
    assert got.keys() == want.keys()  # back at EP2 x TP2: the tensors training wrote, under its names
    for name, payload in want.items():
        t = int(name[len("mp_rank_"):][:2])
        assert got[name]["param_meta"] == payload["param_meta"] and got[name]["ep_size"] == 2
        assert got[name]["model"][0].keys() == payload["model"][0].keys()
        real = max(0, min(56, VOCAB - t * 56))  # vocabulary shards (56 rows at TP2): this rank's real rows
        for k, v in payload["model"][0].items():
            rows = real if "word_emb" in k or "output_layer" in k else None
            assert torch.equal(got[name]["model"][0][k][:rows], v[:rows]), (name, k)
        same_optimizer(got[name]["optimizer"], payload["optimizer"], 56, real)


@pytest.mark.parametrize("variant", list(MODELS))
def test_ep4_conversion_gives_the_same_logits_and_loss(variant, sources, tmp_path):
    out = str(tmp_path / "ep4")
    assert convert("GPT", "--load-dir", sources[variant], "--save-dir", out, "--target-tensor-parallel-size", 1,
                   "--target-expert-parallel-size", 4) == 0
    want = reference(sources[variant])
    labels = TOKENS.roll(-1, dims=1)
    for logits in run_ranks(4, ep4_logits, variant, out):
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(F.cross_entropy(logits.flatten(0, 1), labels.flatten()),
                                   F.cross_entropy(want.flatten(0, 1), labels.flatten()), rtol=1e-6, atol=0)


@pytest.mark.parametrize("variant", list(MODELS))
def test_printed_flags_describe_the_converted_moe_model(variant, sources, tmp_path, capsys):
    from megatron_lite.arguments import parse_args
    from megatron_lite.checkpoint.arch import arch_differences
    from megatron_lite.checkpoint.format import ARCH_FIELDS

    out = tmp_path / "ep4"
    assert convert("GPT", "--load-dir", sources[variant], "--save-dir", out, "--target-tensor-parallel-size", 2,
                   "--target-expert-parallel-size", 4) == 0
    flags = shlex.split(capsys.readouterr().out.split("load it with: ")[1].split(" (and the tokenizer flags)")[0])
    assert flags[-1] == "--no-load-rng" and "--no-load-optim" not in flags  # the optimizer state is there
    config = parse_args(flags + ["--mock-data", "--vocab-size", str(VOCAB)], world_size=8)
    run = config.flat()
    saved = merge_checkpoint(str(out))[1]
    assert not arch_differences(saved, config, tuple(k for k in ARCH_FIELDS if k != "padded_vocab_size"))
    moe = [f.name for f in dataclasses.fields(MoEConfig)]
    for key in tuple(moe) + ("expert_model_parallel_size", "sequence_parallel"):
        if saved.get(key) is not None:
            assert run[key] == saved[key], key


# ---------------------------------------------------------------------------------------------
# Hugging Face Mixtral


def test_mixtral_export_gives_the_same_logits_in_transformers(sources, tmp_path):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    assert convert("GPT", "--saver", "hf", "--load-dir", sources["mixtral"], "--save-dir", out) == 0
    assert (out / "tokenizer.json").read_text() == '{"kept": true}'
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(hf).__name__ == "MixtralForCausalLM" and hf.config.num_experts_per_tok == 2
    with torch.no_grad():
        logits = hf(TOKENS).logits
    torch.testing.assert_close(logits, reference(sources["mixtral"]), rtol=1e-5, atol=1e-5)


def test_megatron_mixtral_megatron_round_trip_is_bit_exact(sources, tmp_path):
    pytest.importorskip("safetensors")
    hf, back = tmp_path / "hf", tmp_path / "back"
    assert convert("GPT", "--saver", "hf", "--load-dir", sources["mixtral"], "--save-dir", hf) == 0
    assert convert("GPT", "--loader", "hf", "--load-dir", hf, "--save-dir", back, "--target-tensor-parallel-size", 2,
                   "--target-expert-parallel-size", 2, "--make-vocab-size-divisible-by", 8) == 0
    got, cfg = merge_checkpoint(str(back))
    assert_same_weights(got, merge_checkpoint(sources["mixtral"])[0], VOCAB)
    assert (back / "tokenizer" / "tokenizer.json").is_file()
    for key in ("num_experts", "moe_router_topk", "moe_ffn_hidden_size", "rotary_base", "num_query_groups"):
        assert cfg[key] == getattr(configs("mixtral").moe if key.startswith(("moe", "num_e")) else
                                   configs("mixtral").model, key), key


@pytest.mark.parametrize("grouped", [False, True])
def test_mixtral_import_gives_the_same_logits(grouped, tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(4)
    cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                                     num_attention_heads=8, num_key_value_heads=4, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=16, rope_theta=5000.0,
                                     rms_norm_eps=1e-6, tie_word_embeddings=False)
    model = transformers.MixtralForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(str(tmp_path / "hf"))
    out = tmp_path / "mega"
    assert convert("GPT", "--loader", "hf", "--load-dir", tmp_path / "hf", "--save-dir", out,
                   "--target-expert-parallel-size", 2, "--make-vocab-size-divisible-by", 8,
                   *(["--moe-grouped-gemm"] if grouped else [])) == 0
    assert sorted(os.listdir(out / "release")) == ["mp_rank_00_000_000", "mp_rank_00_000_001"]
    ours, saved = load_gpt_checkpoint(str(out))
    assert saved["moe_grouped_gemm"] == grouped and saved["num_experts"] == 4
    with torch.no_grad():
        torch.testing.assert_close(ours(TOKENS)[..., :VOCAB], model(TOKENS).logits, rtol=1e-5, atol=1e-5)


def test_mixtral_refuses_what_it_cannot_express(sources, tmp_path, capsys):
    base = merge_checkpoint(sources["mixtral"])[1]
    check_mixtral(base)
    for change, words in [
        (dict(moe_shared_expert_intermediate_size=32), "--moe-shared-expert-intermediate-size"),
        (dict(moe_router_score_function="sigmoid"), "--moe-router-score-function sigmoid"),
        (dict(moe_router_enable_expert_bias=True), "--moe-router-enable-expert-bias"),
        (dict(moe_expert_capacity_factor=1.0), "--moe-expert-capacity-factor"),
        (dict(moe_router_num_groups=2, moe_router_group_topk=1), "--moe-router-num-groups"),
        (dict(moe_router_pre_softmax=True), "--moe-router-pre-softmax"),
        (dict(moe_router_topk_scaling_factor=2.0), "--moe-router-topk-scaling-factor"),
        (dict(moe_router_load_balancing_type=["sinkhorn"]), "sinkhorn"),
        (dict(moe_layer_freq="([1,0]*2)"), "--moe-layer-freq"),
        (dict(disable_bias_linear=False), "--disable-bias-linear"),
        (dict(normalization="LayerNorm"), "--normalization LayerNorm cannot be expressed in the mixtral format"),
        (dict(position_embedding_type="learned_absolute"), "--position-embedding-type learned_absolute cannot be"),
    ]:
        with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace("[", r"\[")):
            check_mixtral({**base, **change})
    cases = [  # through the command line: exit 2, one line, nothing written
        (["--saver", "hf", "--load-dir", sources["grouped"]], "--moe-shared-expert-intermediate-size"),
        (["--saver", "hf", "--hf-style", "llama", "--load-dir", sources["mixtral"]], "--num-experts 4"),
        (["--load-dir", sources["mixtral"], "--target-expert-parallel-size", 3], "--target-expert-parallel-size 3"),
        (["--load-dir", sources["mixtral"], "--moe-grouped-gemm"], "--moe-grouped-gemm"),
    ]
    for i, (argv, words) in enumerate(cases):
        assert convert("GPT", *argv, "--save-dir", tmp_path / f"out{i}") == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err, err
        assert not (tmp_path / f"out{i}").exists()


def test_moe_dataclass_fields_are_what_the_converter_reads():
    """The converter rebuilds models from the saved flat config: every MoE field must be in it."""
    flat = configs("grouped").flat()
    assert all(f.name in flat for f in dataclasses.fields(MoEConfig))


# ---------------------------------------------------------------------------------------------
# Parallel folding (mp_rank_TT_PPP_EEE_XX files)


@pytest.mark.parametrize("variant", list(MODELS))
def test_folded_to_unfolded_to_folded_is_bit_exact(variant, sources, tmp_path):
    """A folded grid's torch checkpoint (weights and one Adam step) converts to one process, to an
    unfolded EP2 x TP2 layout and to the other folded layout (the merged weights stay the same), and
    back from the unfolded one to its own sizes: the files training wrote, bit for bit (weights,
    param_meta, moments, masters, groups). EP 4 not dividing DP 2 needs --target-data-parallel-size."""
    src, sizes = sources[f"{variant}_folded"], FOLDED[variant]
    one, unfolded, other, back = (tmp_path / n for n in ("one", "unfolded", "other", "back"))
    assert convert("GPT", "--load-dir", src, "--save-dir", one, "--target-tensor-parallel-size", 1,
                   "--target-expert-parallel-size", 1, "--target-expert-tensor-parallel-size", 1) == 0
    assert convert("GPT", "--load-dir", src, "--save-dir", unfolded, "--target-tensor-parallel-size", 2,
                   "--target-expert-parallel-size", 2, "--target-expert-tensor-parallel-size", 2) == 0
    flip = FOLDED["grouped" if variant == "mixtral" else "mixtral"]
    assert convert("GPT", "--load-dir", unfolded, "--save-dir", other, "--target-tensor-parallel-size", flip["tp"],
                   "--target-expert-parallel-size", flip["ep"], "--target-expert-tensor-parallel-size", flip["etp"],
                   "--target-data-parallel-size", 2) == 0
    assert convert("GPT", "--load-dir", other, "--save-dir", back, "--target-tensor-parallel-size", sizes["tp"],
                   "--target-expert-parallel-size", sizes["ep"], "--target-expert-tensor-parallel-size", sizes["etp"],
                   "--target-data-parallel-size", 4 // sizes["tp"]) == 0
    original, _ = merge_checkpoint(src)
    for out, folded in ((one, False), (unfolded, False), (other, True), (back, True)):
        got, cfg = merge_checkpoint(str(out))
        assert_same_weights(got, original, VOCAB)
        assert all((len(name.split("_")) == 6) == folded for name in _files(str(out), "iter_0000007")), out
    want, got = _files(src, "iter_0000007"), _files(str(back), "iter_0000007")
    assert got.keys() == want.keys(), got.keys()  # training's folders: one per dense x expert shard pair
    rows = padded_vocab_size(VOCAB, 8, sizes["tp"]) // sizes["tp"]
    for name, payload in want.items():
        t = int(name.split("_")[2])
        assert got[name]["param_meta"] == payload["param_meta"] and got[name]["expert_grid_folded"]
        assert got[name]["etp_size"] == payload["etp_size"]
        assert got[name]["model"][0].keys() == payload["model"][0].keys()
        real = max(0, min(rows, VOCAB - t * rows))
        for k, v in payload["model"][0].items():
            cut = real if "word_emb" in k or "output_layer" in k else None
            assert torch.equal(got[name]["model"][0][k][:cut], v[:cut]), (name, k)
        same_optimizer(got[name]["optimizer"], payload["optimizer"], rows, real)


def test_bad_folded_target_layouts_exit_2(sources, tmp_path, capsys):
    """Target expert sizes the model cannot take: one line naming the option, exit 2, nothing written."""
    src = sources["mixtral_folded"]
    cases = [
        (["--target-expert-tensor-parallel-size", 3], "--target-expert-tensor-parallel-size 3"),  # ffn 16
        (["--target-expert-tensor-parallel-size", 0], "--target-expert-tensor-parallel-size must be at least 1"),
        (["--target-data-parallel-size", 0], "--target-data-parallel-size must be at least 1"),
        (["--target-expert-parallel-size", 3], "--target-expert-parallel-size 3"),
        (["--saver", "hf", "--target-expert-tensor-parallel-size", 2], "applies to --saver megatron only"),
    ]
    for i, (argv, words) in enumerate(cases):
        assert convert("GPT", "--load-dir", src, *argv, "--save-dir", tmp_path / f"out{i}") == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err, err
        assert not (tmp_path / f"out{i}").exists()
