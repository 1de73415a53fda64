"""Build a GPTModel in tests from the user-facing ModelConfig plus run settings, as the scripts do.

``build_gpt(model_cfg, state, seed=9, sequence_parallel=True, pre_process=False, ...)`` splits the
keywords into the TransformerConfig's run fields (seed, sequence parallelism, dtype, recompute plan, context parallelism;
the TP size comes from ``state``) and the GPTModel's chunk arguments.
"""

from megatron_lite.models import GPTModel, TransformerConfig

RUN_FIELDS = ("seed", "sequence_parallel", "params_dtype", "recompute_granularity", "recompute_method", "recompute_modules",
              "recompute_num_layers", "context_parallel_size", "cp_comm_type", "hierarchical_context_parallel_sizes")


def transformer_config(model_cfg, state, **run) -> TransformerConfig:
    return TransformerConfig.from_model(model_cfg, tensor_model_parallel_size=state.tp_size, **run)


def build_gpt(model_cfg, state, **kw) -> GPTModel:
    run = {k: kw.pop(k) for k in RUN_FIELDS if k in kw}
    return GPTModel(transformer_config(model_cfg, state, **run), state, **kw)
