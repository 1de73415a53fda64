"""What the planner plans for: a model's shapes (:class:`ModelSpec`), a cluster (:class:`ClusterSpec`),
their presets, and the parameter count each pipeline stage holds per GPU.

``ModelSpec`` carries the field names of the transformer config (``hidden_size``,
``num_query_groups``, ``moe_router_topk``, ``q_lora_rank``, ``mtp_num_layers``, ...), so the FLOP
counter of :mod:`megatron_lite.perf.flops` reads it directly, as the model config and as the MoE config.

Parameters held per GPU (:func:`stage_params`), as the built model holds them:

* attention: multi-head / grouped-query Q, K, V and output projections split over TP; with
  multi-latent attention the down projections (``h x rq``, ``h x (rkv + dr)``) and the latent norms
  are replicated over TP, the up projections (``rq x a(dn + dr)`` or, without q compression,
  ``h x a(dn + dr)``; ``rkv x a(dn + dv)``) and the output (``a dv x h``) are split;
* MLP: split over TP; an MoE layer holds its router (replicated, with a bias when the linears have
  one), ``E / EP`` experts (split over the expert-tensor-parallel size ETP, by default TP; each
  expert's fc2 bias whole on every ETP rank) and its shared experts (split over TP);
* pipeline stages hold the layers of training's split (:mod:`.split`: the layout's pipeline flags
  through :func:`~megatron_lite.parallel.pipeline.partition.pipeline_ranges`; naming none, an even
  split, or for a layer count PP does not divide, the middle stages ``ceil(L / PP)`` layers each and
  the rest shared by the first and last stages, as ``--decoder-first/last-pipeline-num-layers`` would);
* the last stage also holds the multi-token prediction layers (per depth two norms, the ``2h x h``
  projection split over TP, a layer of the last layer's kind and a final norm) and, without the
  first stage, a copy of the word embedding they share.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from ...errors import ConfigError
from ...models.mla_config import check_mla_shape, check_mtp_positions
from ...models.transformer_config import default_ffn_hidden_size
from ...models.window_config import check_causal_window, check_window_fields
from ...moe.layer_pattern import parse_moe_layer_freq
from .split import SPLIT_DEFAULTS, split_ranges


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
    moe_layer_freq: int | str = 1  # N, or a list expression "([0]*3+[1]*58)"
    moe_shared_expert_intermediate_size: int | None = None
    make_vocab_size_divisible_by: int = 128
    normalization: str = "LayerNorm"  # or RMSNorm (no bias)
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None  # None: queries without compression
    kv_lora_rank: int = 512
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    qk_layernorm: bool = False  # MLA: norms of the q and kv latents; else per-head q and k norms
    mtp_num_layers: int = 0
    window_size: tuple[int, int] | None = None  # sliding-window attention (LEFT, RIGHT); None: full
    window_attn_skip_freq: int | str | None = None  # the full-attention layers among them (N or a 0/1 list)

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
        if self.window_size is not None:
            object.__setattr__(self, "window_size", tuple(self.window_size))
        if self.multi_latent_attention:  # training's checks: rotary positions, no query groups, even rotary part
            check_mla_shape(self)
        if self.mtp_num_layers:
            check_mtp_positions(self)
        check_window_fields(self)
        check_causal_window(self.window_size)  # the planner's models are GPTs, as pretrain_gpt.py refuses RIGHT
        if self.is_moe:
            if not 1 <= self.moe_router_topk <= self.num_experts:
                raise ConfigError(f"--moe-router-topk {self.moe_router_topk} must lie between 1 and --num-experts "
                                  f"{self.num_experts}")
            try:
                parse_moe_layer_freq(self.moe_layer_freq, self.num_layers)
            except ValueError as err:
                raise ConfigError(str(err)) from None

    @property
    def position_embedding_type(self) -> str:
        """--position-embedding-type as training names it."""
        return "learned_absolute" if self.learned_positions else "rope"

    @property
    def kv_channels(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def norm_params(self) -> int:
        """Parameters of one norm over the hidden size (LayerNorm: weight and bias)."""
        return self.hidden_size * (1 if self.normalization == "RMSNorm" else 2)

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
    # DeepSeek-V3 (671B, 37B active; MTP 1 adds 11.6B of its own): MLA, 256 routed experts top-8 plus
    # one shared, the first 3 layers dense
    "deepseek-v3": ModelSpec(num_layers=61, hidden_size=7168, num_attention_heads=128, ffn_hidden_size=18432,
                             swiglu=True, add_bias_linear=False, learned_positions=False,
                             untie_embeddings_and_output_weights=True, seq_length=4096, vocab_size=129280,
                             normalization="RMSNorm", multi_latent_attention=True, q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128,
                             qk_pos_emb_head_dim=64, v_head_dim=128, qk_layernorm=True, num_experts=256,
                             moe_router_topk=8, moe_ffn_hidden_size=2048, moe_shared_expert_intermediate_size=2048,
                             moe_layer_freq="([0]*3+[1]*58)", mtp_num_layers=1),
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


def attention_params(spec: ModelSpec) -> tuple[int, int]:
    """``(split over TP, replicated)`` parameters of one layer's attention (biases: column-parallel
    ones split, the output projection's replicated)."""
    h, a = spec.hidden_size, spec.num_attention_heads
    if spec.multi_latent_attention:
        qk, rq, rkv = spec.qk_head_dim + spec.qk_pos_emb_head_dim, spec.q_lora_rank, spec.kv_lora_rank
        split = (h if rq is None else rq) * a * qk + rkv * a * (spec.qk_head_dim + spec.v_head_dim) + a * spec.v_head_dim * h
        replicated = (0 if rq is None else h * rq) + h * (rkv + spec.qk_pos_emb_head_dim)
        if spec.qk_layernorm:
            replicated += (rkv + (0 if rq is None else rq)) * spec.norm_params // h
        return split, replicated
    d = spec.kv_channels
    q, kv = a * d, spec.num_query_groups * d
    qk_norms = 2 * d * spec.norm_params // h if spec.qk_layernorm else 0  # one head's norm each, replicated
    return (h * (q + 2 * kv) + q * h + ((q + 2 * kv) if spec.add_bias_linear else 0),
            (h if spec.add_bias_linear else 0) + qk_norms)


def layer_params(spec: ModelSpec, tp: int, ep: int, moe: bool, etp: int | None = None) -> tuple[float, float]:
    """``(dense, expert)`` parameters of one transformer layer held by one GPU (the module docstring;
    ``etp``: the experts' tensor-parallel size, None for TP)."""
    h, bias = spec.hidden_size, spec.add_bias_linear
    split, replicated = attention_params(spec)
    replicated += 2 * spec.norm_params  # two norms
    if not moe:
        return (split + _mlp_params(spec, spec.ffn_hidden_size)) / tp + replicated + (h if bias else 0), 0.0  # fc2's bias
    shared = spec.moe_shared_expert_intermediate_size
    if shared:
        split += _mlp_params(spec, shared)
        replicated += h if bias else 0  # the shared experts' fc2 bias
    router = h * spec.num_experts + (spec.num_experts if bias else 0)
    # each expert's fc2 bias is whole on every expert-tensor-parallel rank, as a row-parallel bias
    experts = spec.num_experts // ep * (_mlp_params(spec, spec.moe_ffn_hidden_size) / (etp or tp) + (h if bias else 0))
    return split / tp + replicated + router, experts


def stage_layers(spec: ModelSpec, pp: int) -> list[int]:
    """Layers per pipeline stage of a layout naming no split: an even split, else the planner's
    smaller first and last stages (:func:`~.split.default_first_last`). One ConfigError when neither works."""
    return [sum(hi - lo for lo, hi in chunks) for chunks in default_ranges(spec, pp)]


def default_ranges(spec: ModelSpec, pp: int) -> tuple:
    """``[pp_rank][chunk] -> (layer_start, layer_end)`` of a PP ``pp`` layout naming no split."""
    return split_ranges(spec.num_layers, spec.mtp_num_layers, pp, 1, tuple(SPLIT_DEFAULTS.values()))


def _moe_pattern(spec: ModelSpec) -> list[bool]:
    return parse_moe_layer_freq(spec.moe_layer_freq, spec.num_layers) if spec.is_moe else [False] * spec.num_layers


@lru_cache(maxsize=4096)
def stage_params(spec: ModelSpec, tp: int, pp: int, ep: int, first: bool, last: bool,
                 stage: int | None = None, etp: int | None = None, ranges: tuple | None = None) -> tuple[float, float]:
    """``(dense, expert)`` parameters one GPU of a pipeline stage holds: its layers, the embedding on
    the first stage, the final norm, the output layer (or the tied embedding's copy) and the MTP
    layers on the last. ``stage``: a middle stage's index; ``ranges``: the stage's chunks,
    ``((layer_start, layer_end), ...)`` (:func:`~.split.rank_ranges`), by default those of a split
    naming no flags (:func:`default_ranges`)."""
    if ranges is None:
        ranges = default_ranges(spec, pp)[stage if stage is not None else 0 if first else pp - 1]
    pattern = _moe_pattern(spec)
    stage_pattern = [pattern[i] for lo, hi in ranges for i in range(lo, hi)]
    h = spec.hidden_size
    if last:
        stage_pattern += pattern[-1:] * spec.mtp_num_layers
    dense = expert = 0.0
    for is_moe in stage_pattern:
        d, e = layer_params(spec, tp, ep, is_moe, etp)
        dense, expert = dense + d, expert + e
    table = spec.padded_vocab(tp) * h / tp
    if first:
        dense += table + (spec.seq_length * h if spec.learned_positions else 0)
    if last:
        dense += spec.norm_params  # final norm
        dense += spec.mtp_num_layers * (3 * spec.norm_params + 2 * h * h / tp)  # MTP: enorm, hnorm, final norm; eh_proj
        untied = spec.untie_embeddings_and_output_weights
        # the output layer; without the first stage a copy of the embedding (the tied output layer, MTP's input)
        dense += table * (untied + (not first and (not untied or spec.mtp_num_layers > 0)))
    return dense, expert


def active_params(spec: ModelSpec) -> float:
    """Parameters one token uses in one process (MoE layers: router, top-k and shared experts);
    the MTP layers not counted (``dataclasses.replace(spec, mtp_num_layers=0)`` otherwise)."""
    dense, expert = stage_params(replace(spec, mtp_num_layers=0), 1, 1, 1, True, True)
    one = _mlp_params(spec, spec.moe_ffn_hidden_size) + (spec.hidden_size if spec.add_bias_linear else 0)  # fc2 bias
    routed = sum(_moe_pattern(spec)) * (spec.num_experts or 0) * one
    active = sum(_moe_pattern(spec)) * spec.moe_router_topk * one
    return dense + expert - routed + active
