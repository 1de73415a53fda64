"""TransformerConfig: everything the model layers need, derived and validated in one place.

The run's :class:`~megatron_lite.config.Config` holds the flags as the user gave them.
:meth:`TransformerConfig.from_config` turns them into the one object every layer receives (with the
:class:`~megatron_lite.parallel.state.ParallelState` and its global layer number): defaults filled
(ffn size, key/value groups, head size, position-table rows, padded vocabulary), the *effective*
sequence parallelism (off when TP is 1), the parameter dtype, the seed and the recompute plan. No
layer recomputes any of these. Every shape rule lives in :meth:`__post_init__`, which raises
:class:`~megatron_lite.errors.ConfigError` with one line naming the flag and the fix.

The allowed values of the model's string options are listed here once (the CLI's choices are
taken from these tuples).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from ..activations import ActivationConfig, check_activation_fields
from ..errors import ConfigError
from ..fusions.config import fusion_fields
from ..moe.config import MoEConfig, check_moe_fields, moe_fields
from ..parallel.attention_sink import check_softmax_type
from ..parallel.recompute import check_recompute_modules
from ..parallel.tensor import normal_init, padded_vocab_size, scaled_normal_init, xavier_uniform_init
from ..precision.flags import TRANSFORMER_IMPLS
from ..precision.fp8 import Fp8Gemm, Fp8Recipe
from ..precision.te import TeGemm
from .attention_config import AttentionConfig, check_attention_fields
from .common import param_generator
from .cp_config import check_context_parallel_fields
from .mamba_config import MambaConfig, check_mamba_fields
from .mla_config import MLAConfig, MTPConfig, check_mla_fields, derive_rope_type
from .rope_config import RopeConfig, check_rope_fields
from .window_config import check_window_fields, layer_window
from .yarn import mla_softmax_scale

POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def default_ffn_hidden_size(hidden_size: int, swiglu: bool) -> int:
    """Megatron-LM's MLP width when --ffn-hidden-size is not given: 4h, or for SwiGLU (two input
    projections) 2/3 of that rounded down to a multiple of 64, which keeps the parameter count near
    the 4h GeLU layer's. Raises ConfigError where that rounds to 0 (hidden sizes below 24)."""
    if not swiglu:
        return 4 * hidden_size
    ffn = int((4 * hidden_size * 2 / 3) / 64) * 64
    if ffn < 1:
        raise ConfigError(f"--swiglu with --hidden-size {hidden_size} gives --ffn-hidden-size 0 by Megatron-LM's rule "
                          "int(4 x hidden-size x 2/3 / 64) x 64; set --ffn-hidden-size")
    return ffn


@dataclass
class TransformerConfig(MambaConfig, MoEConfig, MLAConfig, MTPConfig, RopeConfig, AttentionConfig, ActivationConfig):  # fields from the mixins
    # shape ------------------------------------------------------------------------------------
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    ffn_hidden_size: int | None = None  # default 4 x hidden_size (SwiGLU: see default_ffn_hidden_size)
    num_query_groups: int | None = None  # default: one per head (multi-head attention)
    kv_channels: int | None = None  # head size; default hidden_size / num_attention_heads
    seq_length: int = 128
    max_position_embeddings: int | None = None  # rows of the learned position table; default seq_length
    position_embedding_type: str = "learned_absolute"
    rotary_base: int = 10000
    normalization: str = "LayerNorm"
    norm_epsilon: float = 1e-5
    swiglu: bool = False
    openai_gelu: bool = False  # tanh-approximated GeLU (GPT-2's); the exact erf form otherwise
    add_bias_linear: bool = True
    add_qkv_bias: bool = False  # a bias on the QKV projection whatever add_bias_linear says
    apply_layernorm_1p: bool = False  # norms scale by 1 + weight (stored zero-centred, initialised to 0)
    apply_residual_connection_post_layernorm: bool = False  # a residual add takes the norm's output, not its input
    untie_embeddings_and_output_weights: bool = False
    attention_dropout: float = 0.1
    hidden_dropout: float = 0.1
    init_method_std: float = 0.02
    init_method_xavier_uniform: bool = False  # Xavier-uniform linear weights (and embeddings, see init_method)
    embedding_init_method_std: float | None = None  # the embeddings' std (default init_method_std)
    vocab_size: int | None = None  # the tokenizer's; the loss never counts padded rows
    padded_vocab_size: int | None = None  # default: vocab_size rounded up to make_vocab_size_divisible_by x TP
    make_vocab_size_divisible_by: int = 128
    # parallelism and run ----------------------------------------------------------------------
    tensor_model_parallel_size: int = 1
    sequence_parallel: bool = False  # the effective value: always False when TP is 1
    context_parallel_size: int = 1  # ranks splitting every sequence (load-balanced chunks)
    cp_comm_type: str | list[str] = "p2p"  # core attention under CP: one type, or one per layer
    seed: int = 1234
    perform_initialization: bool = True  # False (--no-initialization): weights left as allocated, a checkpoint fills them
    params_dtype: torch.dtype = torch.float32
    recompute_granularity: str | None = None  # None, full (whole layers) or selective (core attention)
    recompute_method: str | None = None  # with full: uniform or block
    recompute_num_layers: int | None = None  # with full: layers per group (uniform) / per chunk (block); default 1
    expert_model_parallel_size: int = 1  # experts are split over this many data-parallel ranks
    spec: list[str] | None = None  # --spec MODULE NAME: the user's layer spec (models/spec_plugin.py)
    # FP8 (fp8 = None: every GEMM in params_dtype) ----------------------------------------------
    fp8: str | None = None  # format: e4m3, or hybrid (E4M3 forward, E5M2 gradients)
    fp8_recipe: str = "delayed"  # delayed or tensorwise scaling
    fp8_margin: int = 0
    fp8_amax_history_len: int = 1
    fp8_amax_compute_algo: str = "most_recent"
    fp8_wgrad: bool = True  # False: weight-gradient GEMMs in params_dtype
    first_last_layers_bf16: bool = False  # keep the first/last layers below out of FP8
    num_layers_at_start_in_bf16: int = 1
    num_layers_at_end_in_bf16: int = 1
    transformer_impl: str = "local"  # transformer_engine: the transformer layers' GEMMs through TE
    # inference: at TP > 1 without sequence parallelism an MoE layer splits the tokens over TP itself
    # (moe/layer.py); training keeps Megatron's rule that MoE at TP > 1 needs --sequence-parallel
    moe_split_tokens_over_tp: bool = False
    # fusions (fusions/config.py maps the --[no-]...-fusion flags here; off unless asked, except the
    # softmax, which has always been SDPA's fused kernel) -----------------------------------------
    bias_activation_fusion: bool = False  # bias + GeLU (tanh approximation) / bias + SwiGLU in one function
    bias_dropout_fusion: bool = False  # residual + dropout(x + bias) in one function
    masked_softmax_fusion: bool = True  # False: attention's explicit scale/mask/softmax math instead of SDPA
    attention_softmax_in_fp32: bool = False  # the unfused softmax (and its mask) in fp32 (the fused kernels always are)
    apply_query_key_layer_scaling: bool = False  # fp16: scores scaled by 1/layer_number, undone in the fp32 softmax
    fp32_residual_connection: bool = False  # the residual stream (embedding output, layer outputs) in fp32
    apply_rope_fusion: bool = False  # rotary embedding through a jit_fuser function
    gradient_accumulation_fusion: bool = False  # weight-gradient GEMMs accumulate into main_grad
    cross_entropy_loss_fusion: bool = False  # the cross-entropy's per-token pieces through jit_fuser
    calculate_per_token_loss: bool = False  # loss_func returns (token-loss sum, token count, reported)
    hierarchical_context_parallel_sizes: list[int] | None = None  # a2a+p2p: [a2a group, ring group]
    recompute_modules: list[str] | None = None  # with selective: Megatron's module names (None: core_attn)
    window_size: list[int] | None = None  # sliding-window attention (left, right); models/window_config.py
    window_attn_skip_freq: str | None = None  # which layers keep full attention
    softmax_type: str = "vanilla"  # --softmax-type: vanilla, off-by-one, learnable (parallel/attention_sink.py)

    def __post_init__(self):
        self._check_shape()
        self._derive()
        self._check_parallel()
        check_context_parallel_fields(self)  # models/cp_config.py
        self._check_recompute()
        self._check_fp8()
        _require(not self.bias_activation_fusion or self.swiglu or self.add_bias_linear,
                 "bias + GeLU fusion needs biases in the linear layers; drop --disable-bias-linear or add "
                 "--no-bias-gelu-fusion")
        check_moe_fields(self)
        check_mla_fields(self)
        check_mamba_fields(self)  # models/mamba_config.py: hybrid Mamba models
        check_rope_fields(self)
        check_attention_fields(self)
        check_recompute_modules(self)
        check_window_fields(self)
        check_softmax_type(self)
        check_activation_fields(self)

    # -- validation ----------------------------------------------------------------------------
    def _check_shape(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
            _require(getattr(self, name) > 0, f"--{name.replace('_', '-')} must be positive")
        for name in ("ffn_hidden_size", "kv_channels", "num_query_groups"):  # None: derived from the others
            value = getattr(self, name)
            _require(value is None or value > 0, f"--{name.replace('_', '-')} must be positive, got {value}")
        tp = self.tensor_model_parallel_size  # before _derive pads the vocabulary to a multiple of it
        _require(tp >= 1, f"--tensor-model-parallel-size must be at least 1, got {tp}")
        _require(self.position_embedding_type in POSITION_EMBEDDING_TYPES,
                 f"--position-embedding-type {self.position_embedding_type!r} is not one of "
                 f"{', '.join(POSITION_EMBEDDING_TYPES)}")
        _require(self.normalization in NORMALIZATIONS,
                 f"--normalization {self.normalization!r} is not one of {', '.join(NORMALIZATIONS)}")
        _require(self.kv_channels is not None or self.hidden_size % self.num_attention_heads == 0,
                 f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads "
                 f"{self.num_attention_heads}; set --kv-channels")
        groups = self.num_query_groups or self.num_attention_heads
        _require(groups > 0 and self.num_attention_heads % groups == 0,
                 f"--num-attention-heads {self.num_attention_heads} is not divisible by --num-query-groups {groups}")
        for name in ("attention_dropout", "hidden_dropout"):
            _require(0.0 <= getattr(self, name) < 1.0, f"--{name.replace('_', '-')} must be in [0, 1)")
        _require(self.make_vocab_size_divisible_by >= 1, "--make-vocab-size-divisible-by must be at least 1")

    def _derive(self) -> None:
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = default_ffn_hidden_size(self.hidden_size, self.swiglu)
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.kv_channels is None:
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.padded_vocab_size is None and self.vocab_size is not None:
            self.padded_vocab_size = padded_vocab_size(
                self.vocab_size, self.make_vocab_size_divisible_by, self.tensor_model_parallel_size)
        if self.tensor_model_parallel_size == 1:
            self.sequence_parallel = False  # nothing to split
        if self.recompute_granularity == "full" and self.recompute_num_layers is None:
            self.recompute_num_layers = 1
        derive_rope_type(self)

    def _check_parallel(self) -> None:
        tp = self.tensor_model_parallel_size
        _require(self.position_embedding_type != "learned_absolute" or self.max_position_embeddings >= self.seq_length,
                 f"--max-position-embeddings {self.max_position_embeddings} is smaller than --seq-length {self.seq_length}")
        _require(self.position_embedding_type != "rope" or self.multi_latent_attention or self.rotary_percent < 1
                 or self.kv_channels % 2 == 0,
                 f"rope needs an even head dimension, got {self.kv_channels} (--kv-channels)")
        for flag, value in (("num-attention-heads", self.num_attention_heads), ("ffn-hidden-size", self.ffn_hidden_size),
                            ("num-query-groups", self.num_query_groups)):
            _require(value % tp == 0, f"--{flag} {value} is not divisible by --tensor-model-parallel-size {tp}"
                     + ("; every rank must hold whole key/value groups" if flag == "num-query-groups" else ""))
        if self.sequence_parallel:
            _require(self.seq_length % tp == 0,
                     f"--sequence-parallel needs --seq-length {self.seq_length} divisible by "
                     f"--tensor-model-parallel-size {tp}")
        if self.padded_vocab_size is not None:
            _require(self.padded_vocab_size % tp == 0,
                     f"padded vocabulary size {self.padded_vocab_size} (TransformerConfig.padded_vocab_size) is not "
                     f"divisible by --tensor-model-parallel-size {tp}; leave it None to pad the vocabulary to a "
                     "multiple of --make-vocab-size-divisible-by x --tensor-model-parallel-size")
            _require(self.vocab_size is None or self.vocab_size <= self.padded_vocab_size,
                     f"vocabulary size {self.vocab_size} (--vocab-size, TransformerConfig.vocab_size) is larger than "
                     f"padded_vocab_size {self.padded_vocab_size}; leave padded_vocab_size None to derive it")

    def cp_comm_type_of(self, layer_number: int) -> str:
        """The context-parallel core attention of global layer ``layer_number`` (1-based)."""
        if isinstance(self.cp_comm_type, str):
            return self.cp_comm_type
        types = list(self.cp_comm_type)  # an MTP layer (after the last) takes the last layer's
        return types[0] if len(types) == 1 else types[min(layer_number, self.num_layers) - 1]

    def window_of(self, layer_number: int) -> tuple[int, int] | None:
        """The sliding window ``(left, right)`` of global layer ``layer_number``, or None (models/window_config.py)."""
        return layer_window(self, layer_number)

    def _check_recompute(self) -> None:
        g, method = self.recompute_granularity, self.recompute_method
        _require(g is None or g in RECOMPUTE_GRANULARITIES,
                 f"--recompute-granularity {g!r}: expected {' or '.join(RECOMPUTE_GRANULARITIES)}")
        if g == "full":
            _require(method in RECOMPUTE_METHODS, "--recompute-granularity full needs --recompute-method uniform or block")
            _require(self.recompute_num_layers >= 1, "--recompute-num-layers must be at least 1")
        _require(method is None or g == "full", "--recompute-method only applies with --recompute-granularity full")
        _require(self.recompute_num_layers is None or g == "full",
                 "--recompute-num-layers only applies with --recompute-granularity full (selective recomputes "
                 "the --recompute-modules parts in every layer); drop it or use full with --recompute-method")

    def _check_fp8(self) -> None:
        _require(self.transformer_impl in TRANSFORMER_IMPLS,
                 f"--transformer-impl {self.transformer_impl}: expected one of {', '.join(TRANSFORMER_IMPLS)}")
        if self.fp8 is None:
            return
        self.fp8_scaling_recipe()  # validates format, recipe, amax algorithm and history length
        if self.first_last_layers_bf16:
            start, end = self.num_layers_at_start_in_bf16, self.num_layers_at_end_in_bf16
            _require(start >= 0 and end >= 0,
                     "--num-layers-at-start-in-bf16 and --num-layers-at-end-in-bf16 must be at least 0")
            _require(start + end <= self.num_layers,
                     f"--num-layers-at-start-in-bf16 {start} + --num-layers-at-end-in-bf16 {end} exceed "
                     f"--num-layers {self.num_layers}; lower them")

        # -- what layers ask for ---------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.kv_channels

    @property
    def attention_scale(self) -> float:
        """The attention logits' scale: --softmax-scale, else 1 / sqrt(head size), or MLA's (with YaRN's mscale)."""
        if self.softmax_scale is not None:
            return self.softmax_scale
        return mla_softmax_scale(self) if self.multi_latent_attention else 1.0 / math.sqrt(self.kv_channels)

    def init_method(self, layer_number: int, name: str, scaled: bool = False):
        """``init_method`` of one parameter: fills its full master weight from a generator seeded by
        (seed, global layer number, name). N(0, std^2), or std / sqrt(2 x num_layers) when ``scaled``
        (Megatron's init of the attention and MLP output projections). Layer 0 is the embedding,
        1..num_layers the transformer layers, num_layers + 1 the output layer.

        Megatron-LM's two init flags: the embeddings (layer 0) draw N(0, embedding_init_method_std^2)
        (default init_method_std); init_method_xavier_uniform draws every other weight (``scaled`` ones
        too) from Xavier's uniform distribution over the whole matrix, and the embeddings as well unless
        embedding_init_method_std gives another std."""
        if not self.perform_initialization:
            return _no_init
        gen = param_generator(self.seed, layer_number, name)
        if layer_number == 0:
            std = self.init_method_std if self.embedding_init_method_std is None else self.embedding_init_method_std
            if not (self.init_method_xavier_uniform and std == self.init_method_std):
                return normal_init(std, gen)
        if self.init_method_xavier_uniform:
            return xavier_uniform_init(gen)
        if scaled:
            return scaled_normal_init(self.init_method_std, self.num_layers, gen)
        return normal_init(self.init_method_std, gen)

    def make_gemm(self, layer_number: int, amax_group=None, expert: bool = False):
        """The GEMM of one linear layer of global layer ``layer_number`` (None: the plain
        ``F.linear`` of :func:`~megatron_lite.parallel.tensor.linear_gemm`). ``0`` is the embedding and
        the output layer, ``num_layers + k`` multi-token prediction depth k. Called once per linear layer, so a precision recipe can return a fresh
        stateful object here; ``amax_group`` is the group a shard's scaling statistics are reduced over:
        the ranks that together hold the whole tensor one process would cast. For the dense layers that
        is tensor x context parallelism (``state.group("tp_cp")``): TP shards the weights (and, under
        sequence parallelism, the norms' tokens; the GEMMs see the all-gathered sequence), CP the tokens
        every GEMM sees. For the experts it is ``state.group("expert_amax")``.

        With FP8 on, the linears of FP8 layers (QKV, attention projection, fc1, fc2; MTP's eh_proj) get their own
        :class:`~megatron_lite.precision.fp8.Fp8Gemm` whose amaxes are MAX-reduced over ``amax_group``;
        the embedding (layer 0) and the output layer stay in ``params_dtype``. ``expert=True`` for an
        MoE expert's fc1/fc2 (one gemm each): its amaxes are reduced over the expert-data-parallel
        group in the per-step update. With ``transformer_impl == "transformer_engine"`` every
        transformer-layer GEMM is a :class:`~megatron_lite.precision.te.TeGemm` instead (FP8 or not)."""
        if self.transformer_impl == "transformer_engine" and 1 <= layer_number <= self.num_layers + (self.mtp_num_layers or 0):
            recipe = self.fp8_scaling_recipe() if self.is_fp8_layer(layer_number) else None
            return TeGemm(recipe, amax_group=amax_group)
        if not self.is_fp8_layer(layer_number):
            return None
        return Fp8Gemm(self.fp8_scaling_recipe(), amax_group=amax_group, expert=expert)

    def is_fp8_layer(self, layer_number: int) -> bool:
        """Whether transformer layer ``layer_number`` (global, 1-based; ``num_layers + k``: multi-token
        prediction depth k) runs its GEMMs in FP8. MTP layers do whenever FP8 is on (as in Megatron-LM,
        whose MTP layers run under the global FP8 context: --first-last-layers-bf16 does not count them)."""
        if self.fp8 is None:
            return False
        if self.num_layers < layer_number <= self.num_layers + (self.mtp_num_layers or 0):
            return True
        if not 1 <= layer_number <= self.num_layers:
            return False
        if not self.first_last_layers_bf16:
            return True
        return self.num_layers_at_start_in_bf16 < layer_number <= self.num_layers - self.num_layers_at_end_in_bf16

    def fp8_scaling_recipe(self) -> Fp8Recipe:
        """The FP8 recipe of this model's FP8 layers (validated on construction)."""
        return Fp8Recipe(format=self.fp8, recipe=self.fp8_recipe, margin=self.fp8_margin,
                         amax_history_len=self.fp8_amax_history_len, amax_compute_algo=self.fp8_amax_compute_algo,
                         wgrad=self.fp8_wgrad)

    def describe_fp8(self) -> str:
        """Which layers run in FP8 and with what recipe (for the startup log); '' without FP8."""
        if self.fp8 is None:
            return ""
        layers = [n for n in range(1, self.num_layers + 1) if self.is_fp8_layer(n)]
        span = f"layers {layers[0]}-{layers[-1]} of {self.num_layers}" if layers else f"no layer of {self.num_layers}"
        experts = ", experts' fc1/fc2" if self.num_experts else ""
        if self.mtp_num_layers:
            span += f" and the {self.mtp_num_layers} MTP layer{'s' if self.mtp_num_layers > 1 else ''}"
        return (f"FP8 {span} (QKV, attention projection, fc1, fc2{experts}; embedding and output layer in "
                f"{str(self.params_dtype).replace('torch.', '')})")

    # -- construction ------------------------------------------------------------------------------
    @classmethod
    def from_model(cls, model, **run) -> TransformerConfig:
        """From a :class:`~megatron_lite.config.ModelConfig` (its fields by name) plus the run-level
        fields in ``run`` (tensor_model_parallel_size, sequence_parallel, seed, params_dtype, recompute_*)."""
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in dataclasses.asdict(model).items() if k in names}
        values["add_bias_linear"] = not model.disable_bias_linear
        values.update(run)
        return cls(**values)

    @classmethod
    def from_config(cls, config) -> TransformerConfig:
        """The model's view of a run's :class:`~megatron_lite.config.Config`."""
        p, t = config.parallel, config.training
        return cls.from_model(
            config.model, tensor_model_parallel_size=p.tensor_model_parallel_size,
            sequence_parallel=p.sequence_parallel, seed=t.seed, params_dtype=config.precision.params_dtype,
            perform_initialization=not config.checkpoint.no_initialization,
            context_parallel_size=p.context_parallel_size, cp_comm_type=list(p.cp_comm_type or ["p2p"]),
            hierarchical_context_parallel_sizes=p.hierarchical_context_parallel_sizes,
            recompute_granularity=t.recompute_granularity, recompute_method=t.recompute_method,
            recompute_num_layers=t.recompute_num_layers, calculate_per_token_loss=t.calculate_per_token_loss,
            recompute_modules=t.recompute_modules,
            expert_model_parallel_size=p.expert_model_parallel_size, **moe_fields(config.moe),
            **_fp8_fields(config.precision), **fusion_fields(config.fusion, config.model.swiglu),
        )


def _no_init(tensor: torch.Tensor) -> None:
    """--no-initialization's ``init_method``: the weights are left as allocated (a checkpoint overwrites them)."""


def _fp8_fields(pr) -> dict:
    """TransformerConfig's FP8 fields from the precision flags (Megatron's names on both sides)."""
    return dict(fp8=pr.fp8_format, fp8_recipe=pr.fp8_recipe, fp8_margin=pr.fp8_margin,
                fp8_amax_history_len=pr.fp8_amax_history_len, fp8_amax_compute_algo=pr.fp8_amax_compute_algo,
                fp8_wgrad=not pr.no_fp8_wgrad, first_last_layers_bf16=pr.first_last_layers_bf16,
                num_layers_at_start_in_bf16=pr.num_layers_at_start_in_bf16,
                num_layers_at_end_in_bf16=pr.num_layers_at_end_in_bf16, transformer_impl=pr.transformer_impl,
                # Megatron: query-key layer scaling turns the fp32 softmax on
                attention_softmax_in_fp32=pr.attention_softmax_in_fp32 or pr.apply_query_key_layer_scaling,
                apply_query_key_layer_scaling=pr.apply_query_key_layer_scaling,
                fp32_residual_connection=pr.fp32_residual_connection)
