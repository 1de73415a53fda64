"""Build a GPTModel in tests from the user-facing ModelConfig plus run settings, as the scripts do.

``build_gpt(model_cfg, state, seed=9, sequence_parallel=True, pre_process=False, ...)`` splits the
keywords into the TransformerConfig's run fields (seed, sequence parallelism, dtype, recompute plan, context parallelism;
the TP size comes from ``state``) and the GPTModel's chunk arguments.

``FUSION_MODEL`` and ``loss_and_grads(config, wrap)``: the small GPT of the fusion tests
(tests/unit/test_fusion*.py) and its loss and every gradient after one step on fixed tokens.
"""

import torch

from megatron_lite.models import GPTModel, TransformerConfig
from megatron_lite.parallel.data_parallel import DistributedDataParallel
from megatron_lite.parallel.state import ParallelState

RUN_FIELDS = ("seed", "sequence_parallel", "params_dtype", "recompute_granularity", "recompute_method", "recompute_modules",
              "recompute_num_layers", "context_parallel_size", "cp_comm_type", "hierarchical_context_parallel_sizes")


def transformer_config(model_cfg, state, **run) -> TransformerConfig:
    return TransformerConfig.from_model(model_cfg, tensor_model_parallel_size=state.tp_size, **run)


def build_gpt(model_cfg, state, **kw) -> GPTModel:
    run = {k: kw.pop(k) for k in RUN_FIELDS if k in kw}
    return GPTModel(transformer_config(model_cfg, state, **run), state, **kw)


FUSION_MODEL = dict(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, seq_length=16,
                    vocab_size=100, padded_vocab_size=128, attention_dropout=0.0, hidden_dropout=0.0,
                    max_position_embeddings=16)


def loss_and_grads(config, wrap: bool):
    """Loss and ``{name: gradient}`` of a GPTModel(config) (seed 0) after one forward and backward on fixed
    tokens; ``wrap``: through DistributedDataParallel, the gradients read from ``main_grad``."""
    state = ParallelState()
    torch.manual_seed(0)
    model = GPTModel(config, state)
    if wrap:  # one bucket per parameter, reduced as soon as it is ready: a weight marked ready before
        # its last gradient (the tied embedding, read by the output layer) raises
        model = DistributedDataParallel(model, state, overlap_grad_reduce=True, bucket_size=1)
    g = torch.Generator().manual_seed(0)
    tokens, labels = torch.randint(0, 100, (2, 16), generator=g), torch.randint(0, 100, (2, 16), generator=g)
    loss = model(tokens, labels=labels).mean()
    loss.backward()
    params = model.module.named_parameters() if wrap else model.named_parameters()
    return loss.detach(), {n: (p.main_grad if wrap else p.grad).clone() for n, p in params}
