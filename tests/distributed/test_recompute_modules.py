"""--recompute-modules under TP2 + sequence parallelism on an MLA + MoE GPT with dropout: every
rank's loss equals the run without recomputation exactly and its gradients within 1e-5 (the
up projections' column-parallel GEMMs gather the sequence again inside the recomputation)."""

import torch

from megatron_lite.config import ModelConfig
from megatron_lite.models import GPTModel, TransformerConfig
from megatron_lite.parallel.random import model_parallel_seed
from tests.harness import cached_state, run_ranks

MODEL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=64, attention_dropout=0.2,
             hidden_dropout=0.2, position_embedding_type="rope", multi_latent_attention=True, kv_lora_rank=16,
             q_lora_rank=24, qk_head_dim=8, qk_pos_emb_head_dim=8, v_head_dim=8, qk_layernorm=True)
MOE = dict(num_experts=4, moe_ffn_hidden_size=16, moe_router_topk=2, moe_shared_expert_intermediate_size=16,
           moe_aux_loss_coeff=0.01, moe_token_dispatcher_type="alltoall", moe_layer_freq=[0, 1])


def check_tp2_sp(modules):
    state = cached_state(tp=2)
    gen = torch.Generator().manual_seed(0)
    tokens, labels = torch.randint(0, 64, (2, 16), generator=gen), torch.randint(0, 64, (2, 16), generator=gen)
    runs = []
    for granularity, mods in ((None, None), ("selective", modules)):
        model_parallel_seed(13, state)
        cfg = TransformerConfig.from_model(ModelConfig(**MODEL), tensor_model_parallel_size=2, sequence_parallel=True,
                                           seed=9, recompute_granularity=granularity, recompute_modules=mods, **MOE)
        model = GPTModel(cfg, state)
        loss = model(tokens, labels=labels)
        loss.mean().backward()
        runs.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (loss_ref, grads_ref), (loss, grads) = runs
    torch.testing.assert_close(loss, loss_ref, rtol=0, atol=0)
    assert set(grads) == set(grads_ref)
    for name, g in grads_ref.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    return True


def test_mla_and_moe_modules_under_tensor_sequence_parallel():
    modules = ["core_attn", "mla_up_proj", "layernorm", "mlp", "moe_act", "shared_experts"]
    assert run_ranks(2, check_tp2_sp, modules) == [True, True]
