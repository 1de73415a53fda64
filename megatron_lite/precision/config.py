"""The precision flags (``--bf16``, ``--fp16`` and loss scaling, FP8): one section of the run's Config.

Every field becomes a flag (``fp8_format`` -> ``--fp8-format``) with the string under it as its help;
the rules that tie them together are in :mod:`megatron_lite.precision.flags`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PrecisionConfig:
    bf16: bool = False
    """bf16 weights and compute, fp32 master weights and gradients."""
    fp16: bool = False
    """fp16 weights and compute with a dynamic loss scaler."""
    loss_scale: float | None = None
    """Static loss scale for fp16 (default: dynamic) or bf16 (default: none)."""
    initial_loss_scale: float = 2.0**32
    """Initial dynamic loss scale."""
    min_loss_scale: float = 1.0
    """Floor of the dynamic loss scale."""
    loss_scale_window: int = 1000
    """Clean steps before the dynamic loss scale doubles."""
    hysteresis: int = 2
    """Overflowing steps tolerated before the loss scale halves."""
    fp32_residual_connection: bool = False
    """Move residual connections to fp32: the embedding's output, the hidden states between layers (and between pipeline stages) and every residual add are fp32 while the layers compute in --bf16/--fp16 (each norm takes the fp32 stream and returns the model's dtype). No effect in fp32."""
    apply_query_key_layer_scaling: bool = False
    """Scale Q * K^T by 1 / layer-number (undone inside the fp32 softmax) for fp16 overflow safety; sets --attention-softmax-in-fp32. Active under --fp16 (Megatron's rule); with --masked-softmax-fusion (SDPA, flash-attn, the CPU kernel, all accumulating the scores in fp32) it changes nothing but is accepted."""
    attention_softmax_in_fp32: bool = False
    """Run attention masking and softmax in fp32 with --no-masked-softmax-fusion (the fused kernels always do)."""
    fp8_format: str | None = None
    """FP8 format: e4m3 or hybrid."""
    fp8_recipe: str = "delayed"
    """FP8 scaling recipe: delayed, tensorwise, blockwise (1x128 / 128x128 blocks) or mxfp8 (1x32 blocks, E8M0 scales)."""
    fp8_margin: int = 0
    """FP8 scaling margin."""
    fp8_amax_history_len: int = 1
    """FP8 amax history length."""
    fp8_amax_compute_algo: str = "most_recent"
    """FP8 amax from the history: max or most_recent."""
    no_fp8_wgrad: bool = False
    """Run the FP8 layers' weight-gradient GEMM in bf16 instead of FP8."""
    first_last_layers_bf16: bool = False
    """Keep the first and last transformer layers in bf16 (counts: --num-layers-at-start/end-in-bf16)."""
    num_layers_at_start_in_bf16: int = 1
    """Transformer layers at the start kept in bf16 with --first-last-layers-bf16."""
    num_layers_at_end_in_bf16: int = 1
    """Transformer layers at the end kept in bf16 with --first-last-layers-bf16."""
    transformer_impl: str = "local"
    """Linear layers: local (native FP8 GEMMs) or transformer_engine (needs Transformer Engine and a GPU)."""
    accumulate_allreduce_grads_in_fp32: bool = False
    """Accepted for Megatron scripts: it changes nothing, gradients are always accumulated over micro-batches and reduced over data-parallel ranks in fp32 (an fp32 main_grad buffer under --bf16, --fp16 and fp32, for every sharding strategy)."""
    grad_reduce_in_fp32: bool = False
    """Accepted for Megatron scripts: it changes nothing, gradients are always reduced over data-parallel ranks in fp32 (the fp32 main_grad buffer, for every sharding strategy)."""
    reduce_scatter_with_fp32_accumulation: bool = field(default=False, metadata={
        "aliases": ("--ddp-reduce-scatter-with-fp32-accumulation",)})
    """Accepted for Megatron scripts: it changes nothing, the sharded strategies' reduce-scatters always sum fp32 gradients (the fp32 main_grad buffer)."""
    no_store_param_remainders: bool = False
    """Accepted for Megatron scripts: it changes nothing, the optimizer always keeps whole fp32 master weights (never a 16-bit weight plus its remainder)."""
    use_precision_aware_optimizer: bool = False
    """Keep Adam's moments in the dtypes of --exp-avg-dtype / --exp-avg-sq-dtype between steps (the update itself is computed in fp32); needs --optimizer adam and the distributed optimizer (as in Megatron-LM)."""
    main_grads_dtype: str = "fp32"
    """Accepted for Megatron scripts: it changes nothing, main gradients are always fp32 (the only value taken; --use-precision-aware-optimizer keeps only Adam's moments in bf16)."""
    main_params_dtype: str = "fp32"
    """Accepted for Megatron scripts: it changes nothing, master weights are always fp32 (the only value taken; --use-precision-aware-optimizer keeps only Adam's moments in bf16)."""
    exp_avg_dtype: str = "fp32"
    """dtype Adam's first moment is stored in between steps: fp32 or bf16 (bf16 needs --use-precision-aware-optimizer)."""
    exp_avg_sq_dtype: str = "fp32"
    """dtype Adam's second moment is stored in between steps: fp32 or bf16 (bf16 needs --use-precision-aware-optimizer)."""
    megatron_fsdp_grad_comm_dtype: str | None = None
    """Accepted for Megatron scripts: it changes nothing, gradients are always reduced over data-parallel ranks in fp32, for every sharding strategy (fp32 is the only value taken)."""

    @property
    def params_dtype(self) -> torch.dtype:
        """The dtype of the model's weights and activations."""
        return torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else torch.float32

    @property
    def residual_dtype(self) -> torch.dtype:
        """The dtype of the hidden states between layers and pipeline stages: fp32 with --fp32-residual-connection."""
        return torch.float32 if self.fp32_residual_connection else self.params_dtype
