"""Typed configuration: dataclasses whose fields become Megatron-LM's command-line flags.

Every field has a one-line help text (the string literal under it); :mod:`megatron_lite.arguments` turns
the fields into argparse flags (``tensor_model_parallel_size`` -> ``--tensor-model-parallel-size``).
:func:`finalize` fills derived values and validates the combination, raising :class:`ConfigError` with
one line naming the flag and the fix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .errors import ConfigError
from .fusions.config import FusionConfig, check_fusion_flags
from .logging_config import LoggingConfig, check_profile_flags
from .lora.config import LoRAConfig, check_lora_flags
from .models.mla_config import MLAConfig, MTPConfig
from .moe.config import MoEConfig
from .precision.config import PrecisionConfig

__all__ = ["Config", "ConfigError", "finalize"]


@dataclass
class ModelConfig(MTPConfig, MLAConfig):  # the MLA / YaRN and MTP flags: models/mla_config.py
    num_layers: int = 2
    """Number of transformer layers."""
    hidden_size: int = 64
    """Transformer hidden size."""
    ffn_hidden_size: int | None = None
    """MLP hidden size (default 4 x hidden-size; with --swiglu int(4 x hidden-size x 2/3 / 64) x 64, as Megatron-LM)."""
    num_attention_heads: int = 4
    """Number of attention heads."""
    group_query_attention: bool = False
    """Use grouped-query attention (needs --num-query-groups)."""
    num_query_groups: int | None = None
    """Number of key/value head groups for GQA/MQA (default: one per head)."""
    kv_channels: int | None = None
    """Per-head dimension (default hidden-size / num-attention-heads)."""
    seq_length: int = 128
    """Sequence length of a training sample."""
    max_position_embeddings: int | None = None
    """Rows of the learned position table (default seq-length)."""
    position_embedding_type: str = "learned_absolute"
    """Position embedding: learned_absolute or rope."""
    rotary_base: int = 10000
    """Base of the rotary embedding frequencies."""
    normalization: str = "LayerNorm"
    """Normalisation layer: LayerNorm or RMSNorm."""
    norm_epsilon: float = 1e-5
    """Epsilon of the normalisation layers."""
    swiglu: bool = False
    """SwiGLU MLP instead of GeLU."""
    openai_gelu: bool = False
    """GeLU with the tanh approximation (GPT-2's) instead of the exact erf form."""
    disable_bias_linear: bool = False
    """No biases in the linear layers."""
    untie_embeddings_and_output_weights: bool = False
    """Separate output-layer weight instead of reusing the input embedding."""
    attention_dropout: float = 0.1
    """Dropout on the attention probabilities."""
    hidden_dropout: float = 0.1
    """Dropout on the attention and MLP outputs."""
    init_method_std: float = 0.02
    """Standard deviation of the weight initialisation."""
    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary to a multiple of this times the tensor-parallel size."""
    vocab_size: int | None = None
    """Vocabulary size for --mock-data / NullTokenizer (otherwise from the tokenizer)."""
    spec: list[str] | None = field(default=None, metadata={"nargs": 2, "metavar": ("MODULE", "NAME")})
    """Layer spec of your own: NAME (a LayerSpec, or a function layer_number -> LayerSpec) in MODULE (on PYTHONPATH, or a .py file path)."""
    padded_vocab_size: int | None = field(default=None, metadata={"cli": False})
    """Derived: vocabulary padded for the embedding and output layers."""


SHAPE_FLAGS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
    "max_position_embeddings", "position_embedding_type", "normalization", "swiglu", "disable_bias_linear",
    "untie_embeddings_and_output_weights", "num_experts", "moe_ffn_hidden_size", "moe_layer_freq",
    "moe_shared_expert_intermediate_size", "moe_grouped_gemm", "moe_router_enable_expert_bias",
    "bert_no_binary_head",  # pretrain_bert.py: the binary head and token-type embeddings
    "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
    "qk_layernorm", "mtp_num_layers",
)
"""The model flags that decide parameter shapes (a weights-only load checks these too)."""

ARCHITECTURE_FLAGS = SHAPE_FLAGS + (  # + the flags that keep the shapes but change the function
    "openai_gelu", "rotary_base", "norm_epsilon", "moe_router_topk", "moe_router_score_function",
    "moe_router_pre_softmax", "moe_router_topk_scaling_factor", "moe_router_num_groups", "moe_router_group_topk",
    "rope_type", "rotary_scaling_factor", "mscale", "mscale_all_dim", "original_max_position_embeddings", "beta_fast",
    "beta_slow", "bias_gelu_fusion", "spec",
)
"""The flags (config field names, any section) that define the model a checkpoint holds. A resume
refuses a checkpoint saved with another value of any of them, naming the flag and both values;
--finetune and --pretrained-checkpoint only those of SHAPE_FLAGS (a change of the others can be
deliberate); ``--use-checkpoint-args`` takes them all from the checkpoint. A new model flag goes
here (or in SHAPE_FLAGS when it decides a shape)."""

DERIVED_FLAGS = ("ffn_hidden_size", "num_query_groups", "kv_channels", "max_position_embeddings", "rope_type")
"""Model flags whose unset value (None) is derived from other architecture flags when the model is
built (and stored derived); a checkpoint whose config holds them unset (written by a converter) is
compared through those other flags."""


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    """Tensor-parallel size (ranks sharing each layer)."""
    pipeline_model_parallel_size: int = 1
    """Pipeline-parallel size (stages)."""
    num_layers_per_virtual_pipeline_stage: int | None = None
    """Layers per virtual stage for the interleaved 1F1B schedule."""
    pipeline_schedule: str = "1f1b"
    """Pipeline schedule: 1f1b (interleaved with virtual stages) or zb-h1 (zero bubble, 1F1B's memory)."""
    decoder_first_pipeline_num_layers: int | None = None
    """Layers on the first pipeline stage (the rest split evenly)."""
    decoder_last_pipeline_num_layers: int | None = None
    """Layers on the last pipeline stage (the rest split evenly)."""
    sequence_parallel: bool = False
    """Split norms and dropout along the sequence over the tensor-parallel group."""
    context_parallel_size: int = 1
    """Context-parallel size: ranks splitting every sequence (load-balanced chunks)."""
    cp_comm_type: list[str] | None = field(default_factory=lambda: ["p2p"])
    """Context-parallel attention: p2p (ring), a2a (Ulysses) or allgather; one value or one per layer."""
    expert_model_parallel_size: int = 1
    """Expert-parallel size."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks."""
    num_distributed_optimizer_instances: int = 1
    """Hybrid sharding: the distributed optimizer shards within DP/N ranks and replicates across N."""
    overlap_grad_reduce: bool = False
    """Overlap the data-parallel gradient reduction with backward."""
    overlap_param_gather: bool = False
    """Overlap the parameter all-gathers with forward (post-step with optim/optim_grads; the next unit's with optim_grads_params)."""
    data_parallel_sharding_strategy: str = "no_shard"
    """What is sharded over data parallel: no_shard, optim (ZeRO-1), optim_grads (ZeRO-2), optim_grads_params (ZeRO-3)."""
    use_megatron_fsdp: bool = False
    """Accepted for Megatron-FSDP scripts: the sharding strategies above are built in."""
    ddp_bucket_size: int | None = None
    """Gradient bucket size in elements (default max(40M, 1M x dp))."""


@dataclass
class TrainingConfig:
    micro_batch_size: int = 2
    """Samples per micro-batch per data-parallel rank."""
    global_batch_size: int | None = None
    """Samples per optimizer step over all ranks (default micro-batch-size x data-parallel size)."""
    train_iters: int = 20
    """Optimizer steps to train for."""
    seed: int = 1234
    """Random seed."""
    eval_interval: int = 1000
    """Evaluate on the validation split every this many steps."""
    eval_iters: int = 10
    """Validation steps (global batches) per evaluation (0 disables evaluation)."""
    recompute_granularity: str | None = None
    """Activation recomputation: full or selective (core attention)."""
    recompute_method: str | None = None
    """For full recomputation: uniform or block."""
    recompute_num_layers: int | None = None
    """Layers per recomputed group (uniform) or recomputed layers per stage (block)."""
    exit_signal_handler: bool = False
    """On SIGTERM save a checkpoint and exit 0."""
    exit_duration_in_mins: float | None = None
    """Save and exit after this many minutes of training."""
    exit_interval: int | None = None
    """Save and exit when the iteration is a multiple of this."""
    check_for_nan_in_loss_and_grad: bool = True
    """Stop the run when the loss or gradient norm is NaN/inf (with --fp16 the loss scaler skips such steps instead)."""


@dataclass
class OptimizerConfig:
    optimizer: str = "adam"
    """Optimizer: adam (AdamW) or sgd."""
    lr: float = 3e-4
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of decay."""
    lr_decay_style: str = "linear"
    """Decay: constant, linear, cosine or WSD."""
    lr_warmup_iters: int = 0
    """Linear warmup steps."""
    lr_decay_iters: int | None = None
    """Steps over which to decay (default train-iters)."""
    lr_wsd_decay_style: str = "exponential"
    """WSD final decay shape: exponential, linear or cosine."""
    lr_wsd_decay_iters: int | None = None
    """Steps of the WSD final decay."""
    weight_decay: float = 0.01
    """Decoupled weight decay (not applied to biases and norms)."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this (0 disables)."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    optimizer_cpu_offload: bool = False
    """Keep fp32 masters and optimizer state of part of this rank's shard on the CPU, stepped there."""
    optimizer_offload_fraction: float = 1.0
    """With --optimizer-cpu-offload: the fraction of this rank's optimizer shard kept on the CPU."""
    overlap_cpu_optimizer_d2h_h2d: bool = False
    """With --optimizer-cpu-offload on a GPU: copy gradients and params on a side stream."""
    override_opt_param_scheduler: bool = field(default=False, metadata={"flag": "--override-opt_param-scheduler"})
    """On resume, use this run's learning-rate flags even where the checkpoint's schedule differs."""
    use_checkpoint_opt_param_scheduler: bool = field(default=False,
                                                     metadata={"flag": "--use-checkpoint-opt_param-scheduler"})
    """On resume, continue the checkpoint's learning-rate schedule whatever this run's flags say."""


@dataclass
class DataConfig:
    data_path: list[str] | None = None
    """Dataset prefix, or weight prefix pairs: w1 p1 w2 p2 ..."""
    split: str = "969,30,1"
    """Train/valid/test split weights."""
    data_cache_path: str | None = None
    """Folder for cached index arrays (default: beside the data)."""
    mock_data: bool = False
    """Train on deterministic random tokens (needs --vocab-size)."""
    tokenizer_type: str | None = None
    """GPT2BPETokenizer, SentencePieceTokenizer, GPTSentencePieceTokenizer, HuggingFaceTokenizer, NullTokenizer, BertWordPieceLowerCase, BertWordPieceCase."""
    vocab_file: str | None = None
    """Tokenizer vocabulary file."""
    merge_file: str | None = None
    """BPE merges file."""
    tokenizer_model: str | None = None
    """SentencePiece .model or tokenizer.json."""
    eod_mask_loss: bool = False
    """Do not train on end-of-document tokens."""
    reset_position_ids: bool = False
    """Restart position ids after each end-of-document token."""
    reset_attention_mask: bool = False
    """Do not attend across end-of-document tokens."""
    num_workers: int = 0
    """Data loader worker processes."""
    dataloader_type: str = "single"
    """Sample order: single (one pass in the dataset's order) or cyclic (reshuffled every epoch)."""
    sft: bool = False
    """Supervised fine-tuning: --data-path holds chat conversations (JSONL or tools/preprocess_sft.py output)."""
    sft_pack_sequences: bool = False
    """With --sft: pack several conversations per sample (positions and attention reset per conversation)."""
    sft_skip_bad_conversations: bool = False
    """With --sft: skip (and count) bad conversations instead of stopping at the first one."""


@dataclass
class CheckpointConfig:
    save: str | None = None
    """Folder to save checkpoints to."""
    load: str | None = None
    """Folder to load a checkpoint from."""
    save_interval: int | None = None
    """Save every this many steps."""
    no_load_optim: bool = False
    """Do not load optimizer state."""
    no_load_rng: bool = False
    """Do not load RNG states."""
    finetune: bool = False
    """Load only the model weights and start at iteration 0."""
    pretrained_checkpoint: str | None = None
    """While --load has no checkpoint: load the model weights from here (any format and layout) and start at iteration 0."""
    ckpt_format: str = "torch"
    """Format to save in: torch (one file per TP x PP rank) or torch_dist (sharded, loads at any layout)."""
    auto_detect_ckpt_format: bool = False
    """Load the checkpoint at --load in whichever format it is."""
    async_save: bool = False
    """Write torch_dist checkpoints in the background while training goes on."""
    use_checkpoint_args: bool = False
    """Take the model flags (architecture, see ARCHITECTURE_FLAGS) from the checkpoint at --load."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    fusion: FusionConfig = field(default_factory=FusionConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    world_size: int = 1
    data_parallel_size: int = 1
    extra_sections: tuple[str, ...] = ()  # a script's own sections (pretrain_bert.py's "bert"), set by parse_args

    def flat(self) -> dict:
        """All fields of all sections in one dict (for logging and checkpoints)."""
        out = {}
        for section in SECTIONS + tuple(self.extra_sections):
            out.update(dataclasses.asdict(getattr(self, section)))
        return out


SECTIONS = ("model", "parallel", "training", "optim", "precision", "data", "checkpoint", "logging", "moe", "fusion",
            "lora")

def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def finalize(config: Config, world_size: int = 1) -> Config:
    """Fill derived values and check the combination for ``world_size`` processes; raises
    ConfigError naming the flag. The model's shape rules live in ``TransformerConfig``."""
    from .parallel.state import ParallelConfigError, RankGrid

    p = config.parallel
    # What no launch can run comes first (a feature not built, a shape that does not split), then
    # what needs another number of processes: one process must not be told to launch more for a
    # combination that would be refused anyway.
    _check_precision(config.precision)
    check_fusion_flags(config.fusion, config.model.disable_bias_linear)
    _check_model(config)
    _check_parallel(config)
    try:
        grid = RankGrid(world_size, tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size,
                        cp=p.context_parallel_size, ep=p.expert_model_parallel_size,
                        dist_opt_instances=max(1, p.num_distributed_optimizer_instances))
    except ParallelConfigError as err:
        raise ConfigError(str(err)) from None
    config.world_size, config.data_parallel_size = world_size, grid.dp
    _check_batch(config)
    _check_schedule(config)
    _check_profile(config)
    _check_data_and_checkpoint(config)
    return config


def _check_model(config: Config) -> None:
    """Validate the model through the TransformerConfig it becomes, and keep its derived sizes in
    the flags (they are saved with checkpoints and read by the FLOPs count)."""
    from .models.transformer_config import TransformerConfig

    m = config.model
    if m.group_query_attention:
        _require(m.num_query_groups is not None, "--group-query-attention needs --num-query-groups")
    model = TransformerConfig.from_config(config)
    for name in DERIVED_FLAGS:
        setattr(m, name, getattr(model, name))
    config.parallel.sequence_parallel = model.sequence_parallel  # off when TP is 1, as in Megatron
    config.training.recompute_num_layers = model.recompute_num_layers
    for f in dataclasses.fields(config.moe):  # MoE defaults filled in (expert FFN size, coefficient list)
        setattr(config.moe, f.name, getattr(model, f.name))
    from .models.spec_plugin import check_spec

    check_spec(config)  # --spec: importable, a LayerSpec (or layer -> LayerSpec), honouring the flags above


def _check_parallel(config: Config) -> None:
    m, p = config.model, config.parallel
    from .parallel.sharding import check_sharding

    check_sharding(config)
    _require(p.ddp_bucket_size is None or p.ddp_bucket_size >= 1, "--ddp-bucket-size must be at least 1")
    pp = p.pipeline_model_parallel_size
    if p.num_layers_per_virtual_pipeline_stage is not None:
        _require(p.pipeline_schedule != "zb-h1", "--pipeline-schedule zb-h1 runs one model chunk per rank; drop "
                 "--num-layers-per-virtual-pipeline-stage or use --pipeline-schedule 1f1b")
        _require(pp >= 2, "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size >= 2")
        per = p.num_layers_per_virtual_pipeline_stage
        _require(per > 0 and m.num_layers % (per * pp) == 0,
                 f"num-layers {m.num_layers} is not divisible by num-layers-per-virtual-pipeline-stage {per} "
                 f"x pipeline-model-parallel-size {pp}")
    elif p.decoder_first_pipeline_num_layers is None and p.decoder_last_pipeline_num_layers is None:
        _require(m.num_layers % pp == 0,
                 f"num-layers {m.num_layers} is not divisible by pipeline-model-parallel-size {pp}; "
                 "change one or set --decoder-first/last-pipeline-num-layers")
    from .parallel.pipeline.partition import layer_ranges

    try:  # the partition itself names the flags when uneven first/last stages do not work out
        layer_ranges(m.num_layers, pp, p.num_layers_per_virtual_pipeline_stage,
                     p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _check_batch(config: Config) -> None:
    t, p, dp = config.training, config.parallel, config.data_parallel_size
    _require(t.micro_batch_size > 0, "--micro-batch-size must be positive")
    if t.global_batch_size is None:
        t.global_batch_size = t.micro_batch_size * dp
    _require(t.global_batch_size % (t.micro_batch_size * dp) == 0,
             f"global-batch-size {t.global_batch_size} is not divisible by micro-batch-size {t.micro_batch_size} "
             f"x data-parallel size {dp}")
    if p.num_layers_per_virtual_pipeline_stage is not None:
        try:
            from .parallel.pipeline.order import check_interleaved_microbatches
            check_interleaved_microbatches(t.global_batch_size // (t.micro_batch_size * dp),
                                           p.pipeline_model_parallel_size, p.pipeline_schedule)
        except ValueError as err:
            raise ConfigError(str(err)) from None


def _check_precision(pr: PrecisionConfig) -> None:
    from .precision.flags import check_precision_flags

    check_precision_flags(pr)


def _check_schedule(config: Config) -> None:
    """Logging/evaluation intervals and the learning-rate schedule."""
    t, o = config.training, config.optim
    for name in ("log_interval", "eval_interval"):
        value = getattr(config.logging if name == "log_interval" else t, name)
        _require(value >= 1, f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if o.lr_decay_iters is None:
        o.lr_decay_iters = t.train_iters
    _require(o.min_lr <= o.lr, f"--min-lr {o.min_lr} is larger than --lr {o.lr}")
    _require(not (o.override_opt_param_scheduler and o.use_checkpoint_opt_param_scheduler),
             "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler exclude each other; pick one")
    _require(o.lr_decay_style in ("constant", "WSD") or o.lr_decay_iters > o.lr_warmup_iters,
             f"--lr-decay-iters {o.lr_decay_iters} (default --train-iters) must exceed --lr-warmup-iters "
             f"{o.lr_warmup_iters} for --lr-decay-style {o.lr_decay_style}")
    if o.lr_decay_style == "WSD":
        _require(o.lr_wsd_decay_iters is not None,
                 "--lr-decay-style WSD needs --lr-wsd-decay-iters (the steps of the final decay)")
        _require(o.lr_wsd_decay_iters is not None and 0 < o.lr_wsd_decay_iters <= o.lr_decay_iters,
                 f"--lr-decay-style WSD needs 0 < --lr-wsd-decay-iters <= --lr-decay-iters {o.lr_decay_iters} "
                 f"(default --train-iters), got {o.lr_wsd_decay_iters}")


def _check_profile(config: Config) -> None:
    from .precision.flags import gpu_visible

    check_profile_flags(config.logging, config.world_size, gpu_visible())


def _check_data_and_checkpoint(config: Config) -> None:
    d, t, cp = config.data, config.training, config.checkpoint
    if d.mock_data or d.tokenizer_type == "NullTokenizer":
        _require(config.model.vocab_size is not None, "--mock-data and NullTokenizer need --vocab-size")
    else:
        _require(d.data_path is not None, "give --data-path (or --mock-data for random tokens)")
        _require(d.tokenizer_type is not None, "--data-path needs --tokenizer-type (and its vocab/model files)")
    _require(cp.save_interval is None or cp.save is not None, "--save-interval needs --save")
    _require(cp.save_interval is None or cp.save_interval >= 1, "--save-interval must be at least 1")
    _require(not t.exit_signal_handler or cp.save is not None, "--exit-signal-handler needs --save")
    _require(not cp.async_save or cp.ckpt_format == "torch_dist", "--async-save needs --ckpt-format torch_dist")
    from .data.sft_dataset import check_sft_flags

    check_sft_flags(config)
    check_lora_flags(config)
