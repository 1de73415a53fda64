"""What the planner plans for: a model's shapes (:class:`ModelSpec`), a cluster (:class:`ClusterSpec`),
their presets, and the parameter count each pipeline stage holds per GPU.

``ModelSpec`` carries the field names of the transformer config (``hidden_size``,
``num_query_groups``, ``moe_router_topk``, ...), so the FLOP counter of :mod:`megatron_lite.perf.flops`
reads it directly, as the model config and as the MoE config.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from ...errors import ConfigError
from ...models.transformer_config import default_ffn_hidden_size
from ...moe.config import parse_moe_layer_freq


@dataclass(frozen=True)
class ModelSpec:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int
    ffn_hidden_size: int | None = None  # None: 4h (SwiGLU: Megatron's 2/3 rule)
    num_query_groups: int | None = None  # None: one per head (multi-head attention)
    swiglu: bool = False
    add_bias_linear: bool = True
    learned_positions: bool = True  # a [seq, h] position table (GPT); False for RoPE
    untie_embeddings_and_output_weights: bool = False
    num_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None  # None: ffn_hidden_size
    moe_layer_freq: int = 1
    make_vocab_size_divisible_by: int = 128

    def __post_init__(self):
        if self.ffn_hidden_size is None:
            object.__setattr__(self, "ffn_hidden_size", default_ffn_hidden_size(self.hidden_size, self.swiglu))
        if self.num_query_groups is None:
            object.__setattr__(self, "num_query_groups", self.num_attention_heads)
        if self.moe_ffn_hidden_size is None:
            object.__setattr__(self, "moe_ffn_hidden_size", self.ffn_hidden_size)
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"--hidden-size {self.hidden_size} must be divisible by --num-attention-heads "
                              f"{self.num_attention_heads}")
        if self.num_attention_heads % self.num_query_groups:
            raise ConfigError(f"--num-attention-heads {self.num_attention_heads} must be divisible by "
                              f"--num-query-groups {self.num_query_groups}")

    @property
    def kv_channels(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts)

    def padded_vocab(self, tp: int) -> int:
        """The vocabulary padded to a multiple of ``make_vocab_size_divisible_by x tp``."""
        step = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // step) * step

    def with_vocab(self, tp: int) -> ModelSpec:
        """This spec with ``vocab_size`` set to the padded vocabulary at TP size ``tp`` (what is multiplied)."""
        return replace(self, vocab_size=self.padded_vocab(tp), make_vocab_size_divisible_by=1)


@dataclass(frozen=True)
class ClusterSpec:
    gpus: int
    gpus_per_node: int = 8
    gpu_memory_gb: float = 80.0
    peak_tflops: float = 312.0  # dense 16-bit matmul peak per GPU
    intra_node_gbps: float = 300.0  # GB/s (gigabytes) per GPU per direction inside a node (NVLink)
    inter_node_gbps: float = 25.0  # GB/s (gigabytes) per GPU per direction between nodes (one NIC per GPU)

    def __post_init__(self):
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise ConfigError(f"--gpus {self.gpus} and --gpus-per-node {self.gpus_per_node} must be positive")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise ConfigError(f"--gpus {self.gpus} must be a multiple of --gpus-per-node {self.gpus_per_node}")


# Published model shapes (sequence lengths are the training lengths of the papers).
MODEL_PRESETS = {
    "gpt3-175b": ModelSpec(num_layers=96, hidden_size=12288, num_attention_heads=96, seq_length=2048,
                           vocab_size=51200),
    "gpt-1t": ModelSpec(num_layers=128, hidden_size=25600, num_attention_heads=160, seq_length=2048,
                        vocab_size=51200),
    "llama3-8b": ModelSpec(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                           ffn_hidden_size=14336, swiglu=True, add_bias_linear=False, learned_positions=False,
                           untie_embeddings_and_output_weights=True, seq_length=8192, vocab_size=128256),
    "llama3-70b": ModelSpec(num_layers=80, hidden_size=8192, num_attention_heads=64, num_query_groups=8,
                            ffn_hidden_size=28672, swiglu=True, add_bias_linear=False, learned_positions=False,
                            untie_embeddings_and_output_weights=True, seq_length=8192, vocab_size=128256),
    "mixtral-8x7b": ModelSpec(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                              ffn_hidden_size=14336, swiglu=True, add_bias_linear=False, learned_positions=False,
                              untie_embeddings_and_output_weights=True, seq_length=4096, vocab_size=32000,
                              num_experts=8, moe_router_topk=2),
}

# DGX A100 80GB: 312 TFLOP/s bf16, NVLink 600 GB/s both ways, 8 x 200 Gb/s InfiniBand per node.
# DGX H100: 989 TFLOP/s dense bf16, NVLink 900 GB/s both ways, 8 x 400 Gb/s InfiniBand per node.
CLUSTER_PRESETS = {
    "a100": dict(gpus_per_node=8, gpu_memory_gb=80.0, peak_tflops=312.0, intra_node_gbps=300.0, inter_node_gbps=25.0),
    "h100": dict(gpus_per_node=8, gpu_memory_gb=80.0, peak_tflops=989.0, intra_node_gbps=450.0, inter_node_gbps=50.0),
}


def _mlp_params(spec: ModelSpec, ffn: int) -> int:
    up = spec.hidden_size * ffn * (2 if spec.swiglu else 1)
    bias = (ffn * (2 if spec.swiglu else 1)) if spec.add_bias_linear else 0
    return up + bias + ffn * spec.hidden_size


def layer_params(spec: ModelSpec, tp: int, ep: int, moe: bool) -> tuple[float, float]:
    """``(dense, expert)`` parameters of one transformer layer held by one GPU.

    Attention (Q, K/V for the query groups, output projection) and MLP weights and column-parallel
    biases are split over ``tp``; norms and the row-parallel biases are replicated. An MoE layer
    holds its router (replicated) and ``num_experts / ep`` experts, each split over TP (expert
    tensor parallelism = TP).
    """
    h, d = spec.hidden_size, spec.kv_channels
    q, kv = spec.num_attention_heads * d, spec.num_query_groups * d
    attention = h * (q + 2 * kv) + q * h + ((q + 2 * kv) if spec.add_bias_linear else 0)
    replicated = 4 * h + (2 * h if spec.add_bias_linear else 0)  # two norms; projection and fc2 biases
    if not moe:
        return (attention + _mlp_params(spec, spec.ffn_hidden_size)) / tp + replicated, 0.0
    experts = spec.num_experts // ep * _mlp_params(spec, spec.moe_ffn_hidden_size) / tp
    return attention / tp + replicated + h * spec.num_experts, experts


@lru_cache(maxsize=4096)
def stage_params(spec: ModelSpec, tp: int, pp: int, ep: int, first: bool, last: bool) -> tuple[float, float]:
    """``(dense, expert)`` parameters one GPU of a pipeline stage holds (``num_layers / pp`` layers,
    the embedding on the first stage, the output layer - or the tied embedding's copy - on the last)."""
    per_stage = spec.num_layers // pp
    pattern = parse_moe_layer_freq(spec.moe_layer_freq, spec.num_layers) if spec.is_moe else [False] * spec.num_layers
    stage = pattern[:per_stage] if first else pattern[-per_stage:]  # the first or the last stage's layers
    dense = expert = 0.0
    for is_moe in stage:
        d, e = layer_params(spec, tp, ep, is_moe)
        dense, expert = dense + d, expert + e
    table = spec.padded_vocab(tp) * spec.hidden_size / tp
    if first:
        dense += table + (spec.seq_length * spec.hidden_size if spec.learned_positions else 0)
    if last:
        dense += 2 * spec.hidden_size  # final norm
        if spec.untie_embeddings_and_output_weights or not first:
            dense += table
    return dense, expert
