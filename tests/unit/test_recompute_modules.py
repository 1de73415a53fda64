"""--recompute-modules (selective recomputation of Megatron-LM's named modules).

Every choice gives the gradients of the run without recomputation exactly (fp32, dropout on: the
recomputation replays the masks), for a dense GPT, an MoE GPT (grouped and sequential experts,
shared experts, aux loss) and an MLA GPT; the activation bytes the live-tensor tracker measures drop
by what each module keeps (Korthikanti's terms for the dense layer); bad names and combinations are
one-line ConfigErrors naming the flag.
"""

import dataclasses

import pytest
import torch

from megatron_lite.config import ModelConfig
from megatron_lite.errors import ConfigError
from megatron_lite.models import GPTModel, TransformerConfig
from megatron_lite.parallel.random import model_parallel_seed
from megatron_lite.parallel.state import ParallelState
from megatron_lite.perf.activation_memory import korthikanti_layer_bytes, saved_activation_bytes

MODEL_FIELDS = {f.name for f in dataclasses.fields(ModelConfig)}


def _gpt(model_kw, state, **run):
    """A GPT of ``model_kw`` (model flags and MoE flags) with the run-level fields ``run``."""
    model = ModelConfig(**{k: v for k, v in model_kw.items() if k in MODEL_FIELDS})
    moe = {k: v for k, v in model_kw.items() if k not in MODEL_FIELDS}
    return GPTModel(TransformerConfig.from_model(model, tensor_model_parallel_size=1, **moe, **run), state)

S, B, H, A, V = 16, 2, 32, 4, 64
SBH = S * B * H
DENSE = dict(num_layers=2, hidden_size=H, num_attention_heads=A, seq_length=S, max_position_embeddings=S,
             vocab_size=V, attention_dropout=0.2, hidden_dropout=0.2)
MOE = dict(DENSE, num_experts=4, moe_ffn_hidden_size=16, moe_router_topk=2, moe_shared_expert_intermediate_size=24,
           moe_aux_loss_coeff=0.01, moe_token_dispatcher_type="alltoall", moe_layer_freq=[0, 1])
MLA = dict(DENSE, position_embedding_type="rope", multi_latent_attention=True, kv_lora_rank=16, q_lora_rank=24,
           qk_head_dim=8, qk_pos_emb_head_dim=8, v_head_dim=8, qk_layernorm=True)


def _run(model_kw, modules, granularity="selective", dtype=torch.float32, **build):
    state = ParallelState()
    model_parallel_seed(11, state)
    model = _gpt(model_kw, state, seed=5, recompute_granularity=granularity, recompute_modules=modules,
                 params_dtype=dtype, **build)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, V, (B, S), generator=gen)
    labels = torch.randint(0, V, (B, S), generator=gen)
    loss = model(tokens, labels=labels)
    loss.mean().backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


CASES = [
    ("dense", DENSE, ["core_attn"]), ("dense", DENSE, ["mlp"]), ("dense", DENSE, ["layernorm"]),
    ("dense", DENSE, ["core_attn", "mlp", "layernorm"]), ("dense", DENSE, []),
    ("moe", MOE, ["moe"]), ("moe", MOE, ["moe_act"]), ("moe", MOE, ["shared_experts"]),
    ("moe", MOE, ["core_attn", "mlp", "moe_act", "shared_experts", "layernorm"]),
    ("moe_grouped", dict(MOE, moe_grouped_gemm=True), ["moe_act", "layernorm"]),
    ("mla", MLA, ["mla_up_proj"]), ("mla", MLA, ["mla_up_proj", "core_attn", "layernorm"]),
    # --apply-residual-connection-post-layernorm: the freed norm outputs are the residuals too
    ("post_ln", dict(DENSE, apply_residual_connection_post_layernorm=True), ["core_attn", "mlp", "layernorm"]),
    ("post_ln_fused", dict(DENSE, apply_residual_connection_post_layernorm=True, bias_dropout_fusion=True),
     ["layernorm"]),
]


@pytest.mark.parametrize("name,model_kw,modules", CASES, ids=[f"{c[0]}-{'+'.join(c[2]) or 'none'}" for c in CASES])
def test_gradients_equal_the_run_without_recomputation(name, model_kw, modules):
    loss_ref, grads_ref = _run(model_kw, None, granularity=None)
    loss, grads = _run(model_kw, modules)
    assert torch.equal(loss, loss_ref)  # the forward is the same computation
    assert set(grads) == set(grads_ref)
    for n in grads_ref:
        torch.testing.assert_close(grads[n], grads_ref[n], rtol=0, atol=0, msg=n)


def test_bias_dropout_fusion_mlp_bias_gets_its_gradient():
    """With --bias-dropout-fusion the MLP leaves fc2's bias to the residual: recomputed, it still gets it."""
    fused = dict(bias_dropout_fusion=True)  # a TransformerConfig field
    loss_ref, grads_ref = _run(DENSE, None, granularity=None, **fused)
    loss, grads = _run(DENSE, ["mlp", "layernorm"], **fused)
    assert torch.equal(loss, loss_ref)
    assert any("linear_fc2.bias" in n for n in grads)
    for n in grads_ref:
        torch.testing.assert_close(grads[n], grads_ref[n], rtol=0, atol=0, msg=n)


# -- activation memory ----------------------------------------------------------------------------

def _layer_bytes(model_kw, modules, granularity="selective"):
    state = ParallelState()
    model_parallel_seed(1, state)
    model = _gpt(dict(model_kw, num_layers=1, attention_dropout=0.1, hidden_dropout=0.1), state, seed=1,
                 params_dtype=torch.bfloat16, recompute_granularity=granularity, recompute_modules=modules)
    x = torch.randn(S, B, H, dtype=torch.bfloat16, requires_grad=True)
    return saved_activation_bytes(model.decoder.layers[0], x)



@pytest.mark.parametrize("model_kw,modules", [(DENSE, ["mlp"]), (dict(MOE, moe_layer_freq=[1, 1]), ["moe"]),
                                              (dict(MOE, moe_layer_freq=[1, 1]), ["shared_experts"])],
                         ids=["dense-mlp", "moe-moe", "moe-shared_experts"])
def test_lora_adapters_behind_frozen_layers_get_their_gradients(model_kw, modules):
    """LoRA on the MLPs only: the first layer's MLP input comes from frozen weights and needs no grad,
    so a recomputed MLP's adapters got no gradient (the loss then none either: backward raised)."""
    from megatron_lite.lora.apply import apply_lora
    from megatron_lite.lora.config import LoRAConfig

    def run(granularity):
        state = ParallelState()
        model_parallel_seed(11, state)
        model = _gpt(model_kw, state, seed=5, recompute_granularity=granularity,
                     recompute_modules=modules if granularity else None)
        lora = LoRAConfig(lora_rank=4, lora_target_modules=["linear_fc1", "linear_fc2"])
        model = apply_lora(model, model.config, lora, state)
        for name, p in model.named_parameters():
            if p.requires_grad:
                torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(len(name)))
        tokens = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(0))
        model(tokens, labels=tokens).mean().backward()
        return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    grads_ref, grads = run(None), run("selective")
    assert grads_ref and set(grads) == set(grads_ref)
    for n in grads_ref:
        assert grads[n] is not None, n
        torch.testing.assert_close(grads[n], grads_ref[n], rtol=0, atol=0, msg=n)


def test_discarded_outputs_are_freed_with_the_graph(monkeypatch):
    """layernorm / moe_act: once backward has run and the model is dropped, every DiscardedOutput and
    the output it refilled are freed at once. A reference cycle (output -> grad_fn -> holder -> output)
    kept them until the garbage collector ran: --memory-report's 'after the step' grew every step."""
    import gc
    import weakref

    from megatron_lite.parallel import recompute

    holders, init = [], recompute.DiscardedOutput.__init__

    def tracked_init(self, fn):
        init(self, fn)
        holders.append(weakref.ref(self))

    monkeypatch.setattr(recompute.DiscardedOutput, "__init__", tracked_init)
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        _run(MOE, ["layernorm", "moe_act"])
        alive = sum(ref() is not None for ref in holders)
    finally:
        if enabled:
            gc.enable()
    assert holders and alive == 0, f"{alive} of {len(holders)} discarded outputs still alive"

NORM_STATS = 2 * 2 * S * B * 2  # two LayerNorms keep a mean and reciprocal std per token (bf16)


def test_dense_memory_drops_by_the_formula_terms():
    """Korthikanti's 34 sbh: mlp drops the GeLU input 8 and fc2 input 8; layernorm drops the QKV and
    fc1 inputs (the norms' outputs, 2 + 2) and the norms' statistics. core_attn is the paper's
    selective recomputation (the formulas' own case)."""
    none = _layer_bytes(DENSE, None, granularity=None)
    core = _layer_bytes(DENSE, ["core_attn"])
    ratio = korthikanti_layer_bytes(S, B, H, A) - korthikanti_layer_bytes(S, B, H, A, recompute="selective")
    assert none - core >= ratio - 2 * A * S * S * B  # the core attention's scores (CPU kernels keep 2 bytes fewer)
    assert core - _layer_bytes(DENSE, ["core_attn", "mlp"]) == 16 * SBH
    assert _layer_bytes(DENSE, None, granularity=None) - _layer_bytes(DENSE, ["mlp"]) == 16 * SBH
    assert core - _layer_bytes(DENSE, ["core_attn", "layernorm"]) == 4 * SBH + NORM_STATS
    # together the MLP's input is the discarded norm output: 34 - 16 - 4 = 14 sbh plus the residual's masks
    assert core - _layer_bytes(DENSE, ["core_attn", "mlp", "layernorm"]) == 20 * SBH + NORM_STATS


def test_moe_and_mla_memory_drops():
    moe = dict(MOE, moe_layer_freq=[1])
    base = _layer_bytes(moe, ["core_attn"])
    for extra in (["moe"], ["moe_act"], ["shared_experts"], ["layernorm"]):
        assert _layer_bytes(moe, ["core_attn", *extra]) < base, extra
    assert _layer_bytes(moe, ["core_attn", "moe"]) < _layer_bytes(moe, ["core_attn", "moe_act", "shared_experts"])
    mla_core = _layer_bytes(MLA, ["core_attn"])
    qkv = (2 * A * (8 + 8) + A * 8) * 2 * S * B  # Q and K of a (dn + dr) channels, V of a dv, bf16
    assert mla_core - _layer_bytes(MLA, ["core_attn", "mla_up_proj"]) == qkv


# -- refusals ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("model_kw,granularity,modules,needle", [
    (DENSE, "selective", ["core_attn", "attention"], "--recompute-modules attention: unknown module"),
    (DENSE, "full", ["mlp"], "only applies with --recompute-granularity selective"),
    (DENSE, None, ["core_attn"], "only applies with --recompute-granularity selective"),
    (DENSE, "selective", ["moe"], "--recompute-modules moe needs a model with --num-experts"),
    (DENSE, "selective", ["moe_act"], "--recompute-modules moe_act needs a model with --num-experts"),
    (dict(MOE, moe_shared_expert_intermediate_size=None), "selective", ["shared_experts"],
     "needs a model with --moe-shared-expert-intermediate-size"),
    (DENSE, "selective", ["mla_up_proj"], "--recompute-modules mla_up_proj needs a model with --multi-latent-attention"),
    (MOE, "selective", ["moe", "moe_act"], "drop moe_act"),
    (dict(MOE, moe_layer_freq=1), "selective", ["core_attn", "mlp"], "mlp recomputes dense MLPs and every layer is an MoE"),
    (dict(MOE, moe_layer_freq=[0, 0]), "selective", ["moe_act", "shared_experts"],
     "moe_act shared_experts recomputes MoE layers and no layer is one"),
])
def test_bad_modules_are_refused(model_kw, granularity, modules, needle):
    kw = dict(recompute_method="uniform") if granularity == "full" else {}
    with pytest.raises(ConfigError, match=needle.replace("+", r"\+")) as err:
        _gpt(model_kw, ParallelState(), recompute_granularity=granularity, recompute_modules=modules, **kw)
    assert "\n" not in str(err.value)
