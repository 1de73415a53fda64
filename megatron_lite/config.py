"""Typed configuration: dataclasses whose fields become Megatron-LM's command-line flags.

Every field has a one-line help text (the string literal under it); :mod:`megatron_lite.arguments` turns
the fields into argparse flags (``tensor_model_parallel_size`` -> ``--tensor-model-parallel-size``).
:func:`megatron_lite.config_checks.finalize` fills derived values and validates the combination,
raising :class:`ConfigError` with one line naming the flag and the fix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .activations import ActivationConfig
from .checkpoint_config import CheckpointConfig
from .errors import ConfigError
from .fusions.config import FusionConfig
from .logging_config import LoggingConfig
from .lora.config import LoRAConfig
from .models.attention_config import AttentionConfig
from .models.mamba_config import MambaConfig
from .models.mla_config import MLAConfig, MTPConfig
from .models.rope_config import RopeConfig
from .moe.config import MoEConfig
from .optim.muon_config import MuonConfig
from .precision.config import PrecisionConfig

__all__ = ["Config", "ConfigError"]

DEFAULT_TRAIN_ITERS = 20
"""--train-iters when neither it nor --train-samples is given (the command line leaves it unset
so that giving both can be refused; finalize fills it in)."""


@dataclass
class ModelConfig(MambaConfig, MTPConfig, MLAConfig, RopeConfig, AttentionConfig, ActivationConfig):  # MLA / YaRN and MTP: models/mla_config.py; rope_config.py; attention_config.py; activations.py
    # a new model flag also goes in arch_flags.py (the flags a checkpoint must match)
    num_layers: int = 2
    """Number of transformer layers."""
    hidden_size: int = 64
    """Transformer hidden size."""
    ffn_hidden_size: int | None = None
    """MLP hidden size (default 4 x hidden-size; with --swiglu int(4 x hidden-size x 2/3 / 64) x 64, as Megatron-LM)."""
    num_attention_heads: int = 4
    """Number of attention heads."""
    group_query_attention: bool = False
    """Use grouped-query attention with --num-query-groups groups (alone: one group, multi-query attention, as Megatron-LM)."""
    num_query_groups: int | None = None
    """Number of key/value head groups for GQA/MQA (needs --group-query-attention; default: 1 with it, as Megatron-LM; one per head without it)."""
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
    init_method_xavier_uniform: bool = False
    """Draw every linear layer's weight (QKV, fc1, the output projections and fc2 too: no depth scaling; the router, the untied output layer) and, unless --embedding-init-method-std gives another std, the embeddings from Xavier's uniform distribution, U(-a, a) with a = sqrt(6 / (fan_in + fan_out)) of the whole (unsharded) matrix."""
    embedding_init_method_std: float | None = None
    """Standard deviation of the embeddings' initialisation (word, position and token-type tables; not the untied output layer); default --init-method-std."""
    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary to a multiple of this times the tensor-parallel size."""
    vocab_size: int | None = None
    """Vocabulary size for --mock-data / NullTokenizer, and TikTokenizer's (default 131072); otherwise from the tokenizer."""
    spec: list[str] | None = field(default=None, metadata={"nargs": 2, "metavar": ("MODULE", "NAME")})
    """Layer spec of your own: NAME (a LayerSpec, or a function layer_number -> LayerSpec) in MODULE (on PYTHONPATH, or a .py file path)."""
    padded_vocab_size: int | None = field(default=None, metadata={"cli": False})
    """Derived: vocabulary padded for the embedding and output layers."""
    add_qkv_bias: bool = False
    """Bias on the QKV projection even with --disable-bias-linear (Qwen2's attention)."""
    apply_layernorm_1p: bool = False
    """Norm weights stored zero-centred: LayerNorm/RMSNorm scale by 1 + weight, the weight starting at 0."""
    apply_residual_connection_post_layernorm: bool = False
    """Each residual add takes the norm's output instead of its input (Megatron-LM's original BERT order): y = n + attn(n) with n = norm(x), then y + mlp(norm(y)) likewise; the final norm stays."""
    window_size: list[int] | None = field(default=None, metadata={"nargs": 2, "metavar": ("LEFT", "RIGHT")})
    """Sliding-window attention: a query at position i sees keys i - LEFT ... i + RIGHT (-1: unbounded; GPT: RIGHT 0). Megatron-LM's "LEFT,RIGHT" is written "LEFT RIGHT" here. Default: full attention."""
    window_attn_skip_freq: str | None = field(default=None, metadata={"metavar": "N"})
    """With --window-size: full-attention layers among the sliding-window ones. N: every N-th layer (layer l, counted from 1, when l mod N is 0); or a list of one 0/1 per layer, e.g. "[1,1,1,0]*2" (1 = window). Default: every layer windowed."""
    softmax_type: str = "vanilla"
    """Attention softmax: vanilla; off-by-one (1 added to every row's denominator); learnable (a trained sink logit per head in the denominator, gpt-oss's sinks)."""


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    """Tensor-parallel size (ranks sharing each layer)."""
    pipeline_model_parallel_size: int = 1
    """Pipeline-parallel size (stages)."""
    num_layers_per_virtual_pipeline_stage: int | None = None
    """Layers per virtual stage for the interleaved 1F1B schedule."""
    pipeline_schedule: str = "1f1b"
    """Pipeline schedule: 1f1b (interleaved with virtual stages) or zb-h1 (zero bubble at 1F1B's memory, interleaved with virtual stages)."""
    decoder_first_pipeline_num_layers: int | None = None
    """Layers on the first pipeline stage (the rest split evenly)."""
    decoder_last_pipeline_num_layers: int | None = None
    """Layers on the last pipeline stage (the rest split evenly)."""
    pipeline_model_parallel_layout: str | None = None
    """What each (virtual) pipeline stage holds, e.g. "Et|(tt|)*2,tL": E embedding, t transformer layer, m multi-token prediction layer, L loss; '|' between stages in virtual-stage order (pp x vp stages: the count sets the virtual stages), X*N and (...)*N repeat. E first, L (after the m layers) last; every other stage holds a t."""
    account_for_embedding_in_pipeline_split: bool = False
    """The even pipeline split counts the embedding as one layer of the first stage."""
    account_for_loss_in_pipeline_split: bool = False
    """The even pipeline split counts the loss (the output layer) as one layer of the last stage."""
    sequence_parallel: bool = False
    """Split norms and dropout along the sequence over the tensor-parallel group."""
    context_parallel_size: int = 1
    """Context-parallel size: ranks splitting every sequence (load-balanced chunks)."""
    cp_comm_type: list[str] | None = field(default_factory=lambda: ["p2p"])
    """Context-parallel attention: p2p (ring), a2a (Ulysses), allgather, or a2a+p2p (hierarchical: needs --hierarchical-context-parallel-sizes); one value or one per layer."""
    expert_model_parallel_size: int = 1
    """Expert-parallel size."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks."""
    num_distributed_optimizer_instances: int = 1
    """Hybrid sharding: every sharded strategy shards within DP x CP / N ranks (experts: expert-DP/N) and replicates across N (with optim_grads/optim_grads_params: HSDP); N must divide DP x CP."""
    overlap_grad_reduce: bool = False
    """Overlap the data-parallel gradient reduction with backward."""
    overlap_param_gather: bool = False
    """Overlap the parameter all-gathers with forward (post-step with optim/optim_grads; the next unit's with optim_grads_params)."""
    data_parallel_sharding_strategy: str = "no_shard"
    """What is sharded over data parallel: no_shard, optim (ZeRO-1), optim_grads (ZeRO-2), optim_grads_params (ZeRO-3)."""
    use_megatron_fsdp: bool = field(default=False, metadata={"aliases": ("--use-custom-fsdp",)})
    """Accepted for Megatron-FSDP scripts (--use-custom-fsdp: its older name): the sharding strategies above are built in."""
    use_contiguous_buffers_in_local_ddp: bool = False
    """Accepted for Megatron scripts: it changes nothing, gradients always live in one contiguous fp32 buffer."""
    ddp_bucket_size: int | None = None
    """Gradient bucket size in elements (default max(40M, 1M x dp))."""
    distributed_backend: str | None = None
    """Process-group backend, nccl or gloo (default: nccl on CUDA, gloo on the CPU; each only on its device)."""
    distributed_timeout_minutes: int = 10
    """Timeout of the process groups' collectives, in minutes."""
    hierarchical_context_parallel_sizes: list[int] | None = None
    """For --cp-comm-type a2a+p2p, two sizes A B with A x B = --context-parallel-size: an all-to-all over heads within A consecutive CP ranks, ring attention across the B such groups."""


@dataclass
class TrainingConfig:
    micro_batch_size: int = 2
    """Samples per micro-batch per data-parallel rank."""
    global_batch_size: int | None = None
    """Samples per optimizer step over all ranks (default micro-batch-size x data-parallel size)."""
    train_iters: int | None = field(default=DEFAULT_TRAIN_ITERS, metadata={"cli_default": None})
    """Optimizer steps to train for (default 20; with --train-samples: train-samples // global-batch-size)."""
    train_samples: int | None = None
    """Samples to train for instead of --train-iters (iterations: this // global-batch-size); the learning-rate schedule then counts samples (--lr-*-samples)."""
    seed: int = 1234
    """Random seed."""
    data_parallel_random_init: bool = False
    """Seed each data-parallel rank's random streams with its own offset (seed + 10 x data-parallel rank: different dropout masks per replica), then broadcast the first replica's weights to the others before training."""
    eval_interval: int = 1000
    """Evaluate on the validation split every this many steps."""
    eval_iters: int = 10
    """Validation steps (global batches) per evaluation (0 disables evaluation)."""
    start_eval_at_iter: int | None = None
    """No validation before this iteration: the --eval-interval passes start at the first multiple at or after it (the end-of-training pass and --skip-train are not held back)."""
    eval_global_batch_size: int | None = None
    """Samples of one validation (and test) iteration over all ranks (default --global-batch-size); a multiple of --eval-micro-batch-size x data-parallel size."""
    eval_micro_batch_size: int | None = None
    """Samples per validation (and test) micro-batch per data-parallel rank (default --micro-batch-size)."""
    full_validation: bool = False
    """Each validation pass covers the whole validation dataset(s) once (as many full global batches as it holds; the samples past the last full one are not evaluated) instead of --eval-iters batches (GPT data only)."""
    multiple_validation_sets: bool = False
    """Evaluate each dataset of the validation split (--valid-data-path, or --data-path with --split; prefixes only, no weights) on its own, with a loss line and TensorBoard / W&B scalars per dataset (GPT data only)."""
    validation_set_names: list[str] | None = None
    """With --multiple-validation-sets: a name per validation dataset, in their order, used in the loss lines and scalars instead of the index (0, 1, ...)."""
    skip_train: bool = False
    """Train no step: evaluate on the validation and test splits at the loaded iteration (--load) and exit; no checkpoint is written."""
    valid_samples: int | None = field(default=None, metadata={"cli": False})
    """Derived: validation samples to build the datasets for, set on a resume whose saved validation position (another --eval-interval / --eval-iters) runs past what the flags give (None: from the flags)."""
    recompute_granularity: str | None = None
    """Activation recomputation: full or selective (core attention)."""
    recompute_method: str | None = None
    """For full recomputation: uniform or block."""
    recompute_num_layers: int | None = None
    """Layers per recomputed group (uniform) or recomputed layers per model chunk (block); 1 to the layers of a chunk (a pipeline stage, or a virtual stage)."""
    exit_signal_handler: bool = False
    """On SIGTERM save a checkpoint and exit 0."""
    exit_duration_in_mins: float | None = None
    """Save and exit after the first step that ends this many minutes after the run started (start-up and checkpoint load included, as a scheduler's time limit counts them; 0: no limit)."""
    exit_interval: int | None = None
    """Save and exit when the iteration is a multiple of this."""
    check_for_nan_in_loss_and_grad: bool = True
    """Stop the run when the loss or gradient norm is NaN/inf (with --fp16 a step whose gradients overflow is skipped by the loss scaler instead; a NaN/inf loss still stops it)."""
    rerun_mode: str = "validate_results"
    """What a failed result check does (Megatron-LM's rerun state machine): validate_results reruns the step's forward and backward on the same micro-batches and generator states before the optimizer step; a result the rerun does not reproduce is a transient fault (a NaN/inf: exit 17, nothing saved); a reproduced NaN/inf saves the checkpoint before the step and exits 16 to rerun it on other hardware after the restart (exit 17 with the verdict; without --save it stops the run as --check-for-nan-in-loss-and-grad says); a spiky loss or large gradients are trained on; disabled checks without rerunning (report_stats is not built)."""
    check_for_spiky_loss: bool = False
    """Check each micro-batch's loss against 10x the largest of the first 100 checked (from the run's second step); a spiky one reruns the step (--rerun-mode validate_results), then training goes on."""
    check_for_large_grads: bool = False
    """Check this rank's gradient norm against 10x the largest of the first 100 checked steps; large gradients rerun the step (--rerun-mode validate_results), then training goes on."""
    error_injection_rate: int = 0
    """Fail a result check on purpose about once every N checked steps on each rank, to test --rerun-mode validate_results (0: never)."""
    error_injection_type: str = "transient_error"
    """What the reruns of an injected failure show: transient_error (it differs: a transient fault), persistent_error (reproduced on the same hardware, not on other hardware) or correct_result (reproduced on both); with --save both of these exit 16, then 17 after the restart; without, a persistent error stops as on a NaN and a correct result is trained on."""
    iterations_to_skip: list[int] = field(default_factory=list)
    """Iterations whose step is skipped, counted from 0 (N: the step logged as iteration N + 1): its global batch is read and not trained on, and the learning rate does not move."""
    result_rejected_tracker_filename: str | None = None
    """A file listing every rejected result (a failed check, its reruns' verdicts: one line each, rewritten whole under a temporary name); read at start-up: an iteration rejected and reproduced twice on the same rank (and on no other rank of a job) is skipped as --iterations-to-skip does."""
    check_weight_hash_across_dp_replicas_interval: int | None = None
    """Before the first step and every N iterations, hash every parameter on each data-parallel replica and stop (exit 1) when they differ (not with ZeRO-3, whose ranks hold different shards)."""
    rampup_batch_size: list[int] | None = field(default=None, metadata={
        "nargs": 3, "metavar": ("START", "INCREMENT", "SAMPLES")})
    """Ramp the global batch up from START by INCREMENT to --global-batch-size over the first SAMPLES consumed samples (needs --train-samples)."""
    decrease_batch_size_if_needed: bool = False
    """Round each global batch down to a multiple of micro-batch-size x data-parallel size instead of refusing one that does not divide."""
    use_mcore_models: bool = False
    """Accepted for Megatron scripts: there is one model implementation (Megatron-Core's layout)."""
    use_cpu_initialization: bool = False
    """Accepted for Megatron scripts: weights are always drawn on the CPU, whole, then sliced, so they are the same at any TP size."""
    calculate_per_token_loss: bool = False
    """Loss = sum of token losses / loss tokens of the whole global batch (all micro-batches, DP and CP ranks), not the mean of per-micro-batch means; the logged lm loss is the same figure."""
    recompute_activations: bool = False
    """Megatron-LM's shorthand for --recompute-granularity selective (recompute core attention in the backward pass)."""
    manual_gc: bool = False
    """Disable Python's automatic garbage collector during training and collect at fixed points (start, --manual-gc-interval, around evaluation) so ranks pause together."""
    manual_gc_interval: int = 0
    """With --manual-gc: run a full collection every this many iterations (0: never between steps)."""
    manual_gc_eval: bool = True
    """With --manual-gc: collect before and after each evaluation (--no-manual-gc-eval skips it)."""
    deterministic_mode: bool = False
    """Deterministic execution: torch.use_deterministic_algorithms, cuDNN deterministic, fixed cuBLAS workspace (on CUDA NCCL_ALGO must be set, e.g. Ring); slower, for debugging."""
    empty_unused_memory_level: int = 0
    """torch.cuda.empty_cache() to reduce fragmentation: 0 never, 1 after each forward-backward (training and evaluation), 2 also after each optimizer step; no-op on the CPU."""
    recompute_modules: list[str] | None = None
    """With --recompute-granularity selective: the parts of each layer recomputed in backward (default core_attn): core_attn, mlp (dense MLP), moe (whole MoE layer), moe_act (experts' activation), shared_experts, layernorm (both norms), mla_up_proj (MLA's up projections, rotary and core attention)."""


@dataclass
class OptimizerConfig(MuonConfig):  # the --muon-* flags: optim/muon_config.py
    optimizer: str = "adam"
    """Optimizer: adam (AdamW), sgd, or muon (Muon for the linear layers' matrices, AdamW for the rest)."""
    lr: float = 3e-4
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of decay."""
    lr_decay_style: str = "linear"
    """Decay: constant, linear, cosine, inverse-square-root (lr x sqrt(warmup / step) after warmup, not below min-lr) or WSD."""
    lr_warmup_iters: int = 0
    """Linear warmup steps."""
    lr_warmup_init: float = 0.0
    """Learning rate the linear warmup starts from (it rises from this to --lr over the warmup); needs a warmup (--lr-warmup-iters, -samples or -fraction)."""
    lr_decay_iters: int | None = None
    """Steps over which to decay (default train-iters)."""
    lr_wsd_decay_style: str = "exponential"
    """WSD final decay shape: exponential, linear, cosine or minus_sqrt (1 - sqrt of the decay's fraction)."""
    lr_wsd_decay_iters: int | None = None
    """Steps of the WSD final decay."""
    lr_warmup_samples: int = 0
    """With --train-samples: linear warmup samples."""
    lr_decay_samples: int | None = None
    """With --train-samples: samples over which to decay (default train-samples)."""
    lr_wsd_decay_samples: int | None = None
    """With --train-samples: samples of the WSD final decay."""
    lr_warmup_fraction: float | None = None
    """Warmup as a fraction of the decay (iterations or samples), instead of --lr-warmup-iters/-samples."""
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
    sgd_momentum: float = 0.9
    """Momentum factor of --optimizer sgd."""
    optimizer_cpu_offload: bool = False
    """Keep fp32 masters and optimizer state of part of this rank's shard on the CPU, stepped there."""
    optimizer_offload_fraction: float = 1.0
    """With --optimizer-cpu-offload: the fraction of this rank's optimizer shard kept on the CPU."""
    overlap_cpu_optimizer_d2h_h2d: bool = False
    """With --optimizer-cpu-offload on a GPU: copy gradients and params on a side stream."""
    override_opt_param_scheduler: bool = field(default=False, metadata={
        "flag": "--override-opt_param-scheduler", "aliases": ("--override-opt-param-scheduler",)})
    """On resume, use this run's learning-rate flags even where the checkpoint's schedule differs."""
    use_checkpoint_opt_param_scheduler: bool = field(default=False, metadata={
        "flag": "--use-checkpoint-opt_param-scheduler", "aliases": ("--use-checkpoint-opt-param-scheduler",)})
    """On resume, continue the checkpoint's learning-rate schedule whatever this run's flags say."""
    start_weight_decay: float | None = None
    """With --weight-decay-incr-style linear or cosine: the weight decay at the first step."""
    end_weight_decay: float | None = None
    """With --weight-decay-incr-style linear or cosine: the weight decay reached at the last step (--train-iters, or --train-samples)."""
    weight_decay_incr_style: str = "constant"
    """How the weight decay moves from --start-weight-decay to --end-weight-decay over the run: constant (--weight-decay throughout), linear or cosine."""
    decoupled_lr: float | None = None
    """Peak learning rate of the input embedding and output layer (the word embedding weight, the output layer weight, a tied copy on the last pipeline stage); the rest keep --lr. Same schedule."""
    decoupled_min_lr: float | None = None
    """With --decoupled-lr: the embedding and output layer's learning rate at the end of decay (default --min-lr)."""


@dataclass
class DataConfig:
    data_path: list[str] | None = None
    """Dataset prefix, or weight prefix pairs: w1 p1 w2 p2 ..."""
    train_data_path: list[str] | None = None
    """Instead of --data-path and --split: the training set's own prefix or blend (w1 p1 w2 p2 ...), every document of it."""
    valid_data_path: list[str] | None = None
    """With --train-data-path: the validation set's own prefix or blend (none: no validation)."""
    test_data_path: list[str] | None = None
    """With --train-data-path: the test set's own prefix or blend."""
    split: str = "969,30,1"
    """Train/valid/test split weights."""
    data_cache_path: str | None = None
    """Folder for cached index arrays (default: beside the data)."""
    mock_data: bool = False
    """Train on deterministic random tokens (needs --vocab-size)."""
    tokenizer_type: str | None = None
    """GPT2BPETokenizer, SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer (SentencePiece, a BOS before every text), TikTokenizer (a tiktoken vocabulary .json, needs the tiktoken package), HuggingFaceTokenizer, NullTokenizer, BertWordPieceLowerCase, BertWordPieceCase."""
    vocab_file: str | None = None
    """Tokenizer vocabulary file."""
    merge_file: str | None = None
    """BPE merges file."""
    tokenizer_model: str | None = None
    """SentencePiece .model, tokenizer.json (HuggingFaceTokenizer), or the vocabulary .json of TikTokenizer (a list of {rank, token_bytes, token_str})."""
    tiktoken_pattern: str | None = None
    """TikTokenizer: the regex that splits text before BPE, v1 or v2 (required with TikTokenizer)."""
    tiktoken_num_special_tokens: int = 1000
    """TikTokenizer: the ids 0..N-1 reserved for special tokens (the list of --tiktoken-special-tokens, then <SPECIAL_k> fillers); the vocabulary file's ranks start at id N."""
    tiktoken_special_tokens: list[str] | None = None
    """TikTokenizer: the special tokens from id 0 (default <unk> <s> </s>; must include those three: unk, bos, eos = end of document)."""
    tokenizer_hf_use_fast: bool = False
    """Accepted for Megatron scripts: it changes nothing, HuggingFaceTokenizer always reads tokenizer.json with the tokenizers package (the fast tokenizer)."""
    tokenizer_hf_include_special_tokens: bool = False
    """Accepted for Megatron scripts: it changes nothing, HuggingFaceTokenizer always encodes with what its post-processor adds (a BOS)."""
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
    mmap_bin_files: bool = True
    """Memory-map the .bin data files (--no-mmap-bin-files: read each sample's tokens with file reads instead, e.g. on file systems where mmap is slow)."""


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
