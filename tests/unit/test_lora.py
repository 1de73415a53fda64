"""LoRA in one process: a fresh adapter changes nothing, merged weights give the adapted logits,
only adapters train, and bad flags are refused in one line.

The adapted model is a tiny GPT (GeLU with biases, or Llama-style SwiGLU/RMSNorm/GQA, or MoE with
sequential and grouped experts); its B matrices are filled with random values, so the adapters
really change the output, and the merge (W + alpha/r B A) must reproduce that output from plain
base weights within 1e-5.
"""

import pytest
import torch

from megatron_lite.config import ModelConfig
from megatron_lite.errors import ConfigError
from megatron_lite.lora.apply import apply_lora, is_adapter_name
from megatron_lite.lora.config import DEFAULT_TARGETS, LoRAConfig
from megatron_lite.lora.merge import merge_lora
from megatron_lite.models import GPTModel
from megatron_lite.parallel.state import ParallelState
from tests.model_helpers import transformer_config

LLAMA = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, disable_bias_linear=True,
             num_query_groups=2, untie_embeddings_and_output_weights=True)
MOE = dict(num_experts=4, moe_ffn_hidden_size=24, moe_router_topk=2)
VARIANTS = {"gpt2": {}, "llama": LLAMA, "moe_sequential": {**LLAMA, **MOE},
            "moe_grouped": {**LLAMA, **MOE, "moe_grouped_gemm": True}}


def _config(variant, **kw):
    model = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=64,
                        padded_vocab_size=64, attention_dropout=0.0, hidden_dropout=0.0,
                        **{k: v for k, v in VARIANTS[variant].items() if k in ModelConfig.__dataclass_fields__})
    moe = {k: v for k, v in VARIANTS[variant].items() if k not in ModelConfig.__dataclass_fields__}
    return transformer_config(model, ParallelState(world_size=1, rank=0), **moe, **kw)


def _models(variant, lora=None):
    """(base model, adapted model with random B) holding the same base weights."""
    config, state = _config(variant), ParallelState(world_size=1, rank=0)
    lora = lora or LoRAConfig(lora_rank=4, lora_alpha=8.0)
    base, adapted = GPTModel(config, state).eval(), apply_lora(GPTModel(config, state), config, lora, state).eval()
    return base, adapted


def _randomise_b(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "linear_out" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


TOKENS = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_fresh_adapters_give_the_base_logits_and_only_adapters_train(variant):
    base, adapted = _models(variant)
    assert torch.equal(base(TOKENS), adapted(TOKENS))  # B = 0: the adapter adds exactly nothing
    trainable = [n for n, p in adapted.named_parameters() if p.requires_grad]
    frozen = [n for n, p in adapted.named_parameters() if not p.requires_grad]
    assert trainable and all(is_adapter_name(n) for n in trainable)
    assert sorted(frozen) == sorted(n for n, _ in base.named_parameters())
    targets = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    assert {next(t for t in targets if t in n) for n in trainable} == set(targets)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_merged_weights_give_the_adapted_logits(variant):
    base, adapted = _models(variant)
    _randomise_b(adapted)
    want = adapted(TOKENS)
    merged = merge_lora(adapted.state_dict(), alpha=8.0, rank=4)
    assert merged.keys() == base.state_dict().keys()
    base.load_state_dict(merged)
    got = base(TOKENS)
    assert not torch.allclose(want, GPTModel(_config(variant), ParallelState(world_size=1, rank=0)).eval()(TOKENS),
                              atol=1e-3), "the random adapters should change the logits"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_multi_latent_attention_projections_take_adapters_and_merge():
    """MLA's column-parallel projections (q_up, kv_up) are targets too; the replicated down
    projections are not."""
    mla = dict(multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=4,
               v_head_dim=6, position_embedding_type="rope")
    model = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=64,
                        padded_vocab_size=64, attention_dropout=0.0, hidden_dropout=0.0, **mla)
    state = ParallelState(world_size=1, rank=0)
    config = transformer_config(model, state)
    lora = LoRAConfig(lora_rank=4, lora_alpha=8.0, lora_target_modules=["linear_q_up_proj", "linear_kv_up_proj",
                                                                         "linear_proj"])
    base, adapted = GPTModel(config, state).eval(), apply_lora(GPTModel(config, state), config, lora, state).eval()
    assert {n.split(".adapter.")[0].rsplit(".", 1)[-1] for n, p in adapted.named_parameters() if p.requires_grad} == {
        "linear_q_up_proj", "linear_kv_up_proj", "linear_proj"}
    _randomise_b(adapted)
    want = adapted(TOKENS)
    base.load_state_dict(merge_lora(adapted.state_dict(), alpha=8.0, rank=4))
    torch.testing.assert_close(base(TOKENS), want, rtol=1e-5, atol=1e-5)


def test_adapter_gradients_reach_a_and_b_and_the_base_gets_none():
    _, adapted = _models("llama")
    _randomise_b(adapted)
    adapted.train()
    adapted(TOKENS, labels=TOKENS).mean().backward()
    for name, p in adapted.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None, name


def test_target_modules_pick_the_layers():
    _, adapted = _models("gpt2", LoRAConfig(lora_rank=4, lora_target_modules=["linear_qkv"]))
    names = [n for n, p in adapted.named_parameters() if p.requires_grad]
    assert names and all("linear_qkv" in n for n in names)


def _check(argv):
    from megatron_lite.arguments import build_parser, config_from_namespace
    from megatron_lite.config_checks import finalize

    base = ["--mock-data", "--vocab-size", "64", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"]
    finalize(config_from_namespace(build_parser().parse_args(base + argv)), 2)


@pytest.mark.parametrize("argv, message", [
    (["--lora-rank", "4"], "--lora-rank needs the base model to adapt: --pretrained-checkpoint"),
    (["--lora-rank", "3", "--tensor-model-parallel-size", "2", "--load", "x"], "--lora-rank 3 is not divisible"),
    (["--lora-rank", "0", "--load", "x"], "--lora-rank must be at least 1"),
    (["--lora-rank", "4", "--lora-dropout", "1", "--load", "x"], "--lora-dropout must be in [0, 1)"),
    (["--lora-rank", "4", "--lora-target-modules", "q_proj", "--load", "x"], "--lora-target-modules q_proj"),
    (["--lora-rank", "4", "--lora-alpha", "0", "--load", "x"], "--lora-alpha must be positive"),
    # without --lora-rank LoRA is off: an adapter flag alone would silently train every weight
    (["--lora-alpha", "16", "--load", "x"], "--lora-alpha needs --lora-rank"),
    (["--lora-dropout", "0.1", "--load", "x"], "--lora-dropout needs --lora-rank"),
    (["--lora-target-modules", "linear_qkv", "--load", "x"], "--lora-target-modules needs --lora-rank"),
    # a known name this model has no layer of would get no adapter while the rest trained
    (["--lora-rank", "4", "--lora-target-modules", "linear_qkv,linear_q_proj", "--load", "x"],
     "--lora-target-modules linear_q_proj: this model has no such layer"),
    (["--lora-rank", "4", "--lora-target-modules", "linear_qkv", "linear_fc1", "--multi-latent-attention",
      "--position-embedding-type", "rope", "--load", "x"],
     "--lora-target-modules linear_qkv: this model has no such layer"),
    (["--lora-rank", "4", "--lora-target-modules", "linear_q_proj", "--multi-latent-attention", "--q-lora-rank", "16",
      "--position-embedding-type", "rope",
      "--load", "x"], "--lora-target-modules linear_q_proj: this model has no such layer"),
])
def test_bad_lora_flags_are_one_line(argv, message):
    with pytest.raises(ConfigError) as err:
        _check(argv)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("argv, targets", [
    (["--multi-latent-attention", "--position-embedding-type", "rope"], DEFAULT_TARGETS),  # MLA adapts those it has
    (["--multi-latent-attention", "--position-embedding-type", "rope", "--q-lora-rank", "16",
      "--lora-target-modules", "linear_q_up_proj",
      "linear_kv_up_proj"], ["linear_q_up_proj", "linear_kv_up_proj"]),
    (["--lora-target-modules", "linear_qkv,linear_fc2"], ["linear_qkv", "linear_fc2"]),
])
def test_target_modules_this_model_has_are_taken(argv, targets):
    from megatron_lite.arguments import build_parser, config_from_namespace
    from megatron_lite.config_checks import finalize

    base = ["--mock-data", "--vocab-size", "64", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"]
    config = config_from_namespace(build_parser().parse_args(base + ["--lora-rank", "4", "--load", "x"] + argv))
    finalize(config, 2)
    assert config.lora.lora_target_modules == targets


def test_resume_compares_the_target_layers_the_model_has():
    """A checkpoint whose saved target list names a layer its model lacks (accepted before such names
    were refused) resumes with that name dropped; MLA's default list equals the targets it adapts."""
    from megatron_lite.checkpoint.format import CheckpointError
    from megatron_lite.checkpoint.pretrained import check_lora_resume

    def resume(saved_targets, mine, mla=False):
        saved = {"lora_rank": 4, "lora_alpha": 8.0, "lora_target_modules": saved_targets,
                 "multi_latent_attention": mla, "q_lora_rank": None}
        check_lora_resume("ckpt", saved, LoRAConfig(lora_rank=4, lora_alpha=8.0, lora_target_modules=mine))

    resume(["linear_qkv", "linear_q_proj"], ["linear_qkv"])
    resume(DEFAULT_TARGETS, ["linear_proj", "linear_fc1", "linear_fc2"], mla=True)
    with pytest.raises(CheckpointError, match="--lora-target-modules linear_qkv linear_q_proj"):
        resume(["linear_qkv", "linear_q_proj"], ["linear_qkv", "linear_fc1"])


def test_adapters_start_with_a_xavier_normal_and_b_zero_and_alpha_defaults_to_32():
    """docs/fine-tuning.md: A is Xavier-normal (std sqrt(2 / (r + in))), B zero, and --lora-alpha is 32."""
    lora = LoRAConfig(lora_rank=16)
    assert lora.lora_alpha == 32
    _, adapted = _models("llama", lora)
    checked = 0
    for name, p in adapted.named_parameters():
        if "linear_in" in name:
            want = (2.0 / (p.shape[0] + p.shape[1])) ** 0.5
            assert abs(float(p.std()) / want - 1) < 0.1 and abs(float(p.mean())) < 0.1 * want, name
            checked += 1
        elif "linear_out" in name:
            assert not p.any(), name
    assert checked == 8  # 2 layers x 4 targets


def test_lora_dropout_runs_in_training_only():
    """--lora-dropout drops the adapters' input while training; in eval mode (evaluation, generation) the
    adapted model is deterministic and equals the same adapters without dropout."""
    base, adapted = _models("gpt2", LoRAConfig(lora_rank=4, lora_alpha=8.0, lora_dropout=0.5))
    _, plain = _models("gpt2")
    _randomise_b(adapted)
    plain.load_state_dict(adapted.state_dict())
    with torch.no_grad():
        want = plain(TOKENS)
        assert not torch.allclose(want, base(TOKENS), atol=1e-3)  # the adapters change the logits
        torch.testing.assert_close(adapted.eval()(TOKENS), want, rtol=0, atol=0)
        assert not torch.allclose(adapted.train()(TOKENS), want, atol=1e-3)  # dropout really runs in training


@pytest.mark.parametrize("variant", ["moe_sequential", "moe_grouped"])
def test_target_modules_pick_the_expert_fcs_too(variant):
    """--lora-target-modules linear_qkv linear_fc1: the experts get fc1 adapters, no fc2 ones."""
    _, adapted = _models(variant, LoRAConfig(lora_rank=4, lora_target_modules=["linear_qkv", "linear_fc1"]))
    names = [n for n, p in adapted.named_parameters() if p.requires_grad]
    assert any("experts" in n and "linear_fc1" in n for n in names)
    assert names and all("linear_qkv" in n or "linear_fc1" in n for n in names), names


def test_merge_keeps_the_base_weights_dtype():
    """A bf16 base merges in fp32 and is stored back in bf16 (a dense and a grouped experts' adapter)."""
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g).bfloat16()  # noqa: E731
    state = {"l.weight": rand(6, 5), "l.adapter.linear_in.weight": rand(2, 5), "l.adapter.linear_out.weight": rand(6, 2),
             "mlp.experts.weight1": rand(3, 5, 4), "mlp.experts.linear_fc1_adapter.linear_in.weight": rand(3, 5, 2),
             "mlp.experts.linear_fc1_adapter.linear_out.weight": rand(3, 2, 4)}
    merged = merge_lora(state, alpha=4.0, rank=2)
    assert sorted(merged) == ["l.weight", "mlp.experts.weight1"]
    dense = state["l.weight"].float() + 2.0 * state["l.adapter.linear_out.weight"].float() @ state[
        "l.adapter.linear_in.weight"].float()
    grouped = state["mlp.experts.weight1"].float() + 2.0 * torch.bmm(
        state["mlp.experts.linear_fc1_adapter.linear_in.weight"].float(),
        state["mlp.experts.linear_fc1_adapter.linear_out.weight"].float())
    for name, want in (("l.weight", dense), ("mlp.experts.weight1", grouped)):
        assert merged[name].dtype == torch.bfloat16, name
        assert torch.equal(merged[name], want.bfloat16()), name


def test_compiled_layers_with_adapters_share_one_graph_and_give_the_eager_gradients():
    """--torch-compile with LoRA compiled the first layer twice: the frozen embedding's output enters it
    without requires_grad and every later layer's input has it, a Dynamo guard; now each layer of the
    one shape runs the one graph (cache entries counted as tests/e2e/test_torch_compile.py does), and
    the adapters' gradients are the eager model's."""
    from megatron_lite.fusions.compile import layer_cache_entries
    from megatron_lite.models.transformer import TransformerLayer, compile_layers

    config, state = _config("gpt2"), ParallelState(world_size=1, rank=0)
    eager, compiled = (apply_lora(GPTModel(config, state), config, LoRAConfig(lora_rank=4, lora_alpha=8.0), state)
                       for _ in range(2))
    _randomise_b(eager)
    _randomise_b(compiled)
    torch._dynamo.reset()
    assert compile_layers(compiled, "eager") == 2  # Dynamo alone: the guards are its own
    for model in (eager, compiled):
        model.train()
        model(TOKENS, labels=TOKENS).mean().backward()
    assert layer_cache_entries(TransformerLayer._forward) == 1
    grads = {n: p.grad for n, p in eager.named_parameters() if p.requires_grad}
    for name, p in compiled.named_parameters():
        assert (p.grad is None) == (name not in grads), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, grads[name], rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()
