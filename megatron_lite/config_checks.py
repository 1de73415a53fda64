"""Checks of a whole run's flags: :func:`finalize` fills derived values and validates the combination.

Each problem is a :class:`~megatron_lite.errors.ConfigError` with one line naming the flag and the fix.
The model's own shape rules live in :class:`~megatron_lite.models.transformer_config.TransformerConfig`;
the sections' own checks beside their dataclasses (fusions, logging, LoRA).
"""

from __future__ import annotations

import dataclasses
import math

from .arch_flags import DERIVED_FLAGS
from .checkpoint_config import check_checkpoint_management
from .config import SECTIONS, Config
from .distributed_flags import check_distributed_flags
from .errors import ConfigError
from .fusions.config import check_fusion_flags
from .logging_config import check_logging_flags, check_profile_flags
from .lora.config import check_lora_flags
from .moe.upcycling import check_upcycling_flags
from .optim.muon_config import check_muon_flags
from .optim.precision_adam import check_precision_aware_flags
from .precision.config import PrecisionConfig
from .schedule_checks import check_schedule, check_sgd_momentum, check_train_length
from .training.batch_rampup import check_batch_rampup
from .training.eval_batch import check_eval_batch_flags
from .training.rerun_flags import check_rerun_flags
from .training.validation import check_validation_flags


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def finalize(config: Config, world_size: int = 1, data_from_script: bool = False) -> Config:
    """Fill derived values and check the combination for ``world_size`` processes; raises
    ConfigError naming the flag. The model's shape rules live in ``TransformerConfig``.
    ``data_from_script``: a script's own datasets provider brings the data (no data flag is asked for)."""
    from .moe.config import expert_grid_tp
    from .parallel.rank_grid import ParallelConfigError, RankGrid

    p = config.parallel
    # What no launch can run comes first (a feature not built, a shape that does not split), then
    # what needs another number of processes: one process must not be told to launch more for a
    # combination that would be refused anyway.
    _check_finite(config)
    _check_precision(config.precision)
    check_fusion_flags(config.fusion, config.model.disable_bias_linear)
    _check_model(config)
    _check_parallel(config)
    try:
        grid = RankGrid(world_size, tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size,
                        cp=p.context_parallel_size, ep=p.expert_model_parallel_size,
                        dist_opt_instances=max(1, p.num_distributed_optimizer_instances), etp=expert_grid_tp(config))
    except ParallelConfigError as err:
        raise ConfigError(str(err)) from None
    config.world_size, config.data_parallel_size = world_size, grid.dp
    _check_batch(config)
    check_eval_batch_flags(config)  # --eval-global-batch-size, --eval-micro-batch-size, --start-eval-at-iter
    check_train_length(config)
    check_batch_rampup(config)  # --rampup-batch-size: its rules, and the iterations of --train-samples
    _require(config.training.manual_gc_interval >= 0,
             f"--manual-gc-interval must be at least 0, got {config.training.manual_gc_interval}")
    check_sgd_momentum(config)
    check_muon_flags(config)  # --optimizer muon: its values; not with a sharded optimizer
    check_precision_aware_flags(config)  # --use-precision-aware-optimizer: Adam, distributed optimizer
    check_rerun_flags(config)  # --rerun-mode, --check-for-spiky-loss, --error-injection-*, --iterations-to-skip
    check_schedule(config)
    _check_profile(config)
    _check_data_and_checkpoint(config, data_from_script)
    check_distributed_flags(config)  # --distributed-backend, --distributed-timeout-minutes, --deterministic-mode
    check_logging_flags(config.logging, config.checkpoint.save)
    return config


INF_MEANS_NO_LIMIT = ("clip_grad", "exit_duration_in_mins", "activation_func_clamp_value")
"""The number flags for which ``inf`` is a meaning (no clipping, no time limit, no clamp)."""


def _check_finite(config: Config) -> None:
    """No number flag takes ``nan`` (argparse's float() reads it, and every comparison with it is
    False, so range checks let it through), nor ``inf`` except where that means "no limit"."""
    for section in SECTIONS + tuple(config.extra_sections):
        for f in dataclasses.fields(getattr(config, section)):
            value = getattr(getattr(config, section), f.name)
            for number in (value if isinstance(value, list) else [value]):
                if not isinstance(number, float) or math.isfinite(number):
                    continue
                if math.isinf(number) and f.name in INF_MEANS_NO_LIMIT:
                    continue
                flag = f.metadata.get("flag", "--" + f.name.replace("_", "-"))
                raise ConfigError(f"{flag} must be a finite number, got {number}")


def _check_model_values(config: Config) -> None:
    """Values that would otherwise crash the first step with a traceback or train into NaN."""
    m, jitter = config.model, config.moe.moe_input_jitter_eps
    _require(m.vocab_size is None or m.vocab_size >= 1, f"--vocab-size must be at least 1, got {m.vocab_size}")
    _require(m.init_method_std >= 0, f"--init-method-std must be at least 0, got {m.init_method_std}")
    _require(m.embedding_init_method_std is None or m.embedding_init_method_std >= 0,
             f"--embedding-init-method-std must be at least 0, got {m.embedding_init_method_std}")
    _require(m.position_embedding_type != "rope" or m.rotary_base > 0,  # base ** (-2i/d): inf, then NaN losses
             f"--rotary-base must be positive with --position-embedding-type rope, got {m.rotary_base}")
    _require(m.norm_epsilon >= 0, f"--norm-epsilon must be at least 0, got {m.norm_epsilon}")
    _require(jitter is None or jitter >= 0, f"--moe-input-jitter-eps must be at least 0, got {jitter}")


def _check_model(config: Config) -> None:
    """Validate the model through the TransformerConfig it becomes, and keep its derived sizes in
    the flags (they are saved with checkpoints and read by the FLOPs count)."""
    from .models.mla_config import unused_deepseek_flag
    from .models.transformer_config import TransformerConfig
    from .moe.config import unused_moe_flag

    m, t = config.model, config.training
    _check_model_values(config)
    if t.recompute_activations:
        _require(t.recompute_granularity in (None, "selective"), "--recompute-activations means --recompute-"
                 "granularity selective, not full; drop one of the two")
        t.recompute_granularity = "selective"
    _translate_moe_layer_recompute(config)
    if m.group_query_attention and m.num_query_groups is None:
        m.num_query_groups = 1  # Megatron-LM's default --num-query-groups: multi-query attention
    elif not m.group_query_attention:  # Megatron-LM ignores --num-query-groups without --group-query-attention (one group per head)
        _require(m.num_query_groups in (None, m.num_attention_heads),
                 f"--num-query-groups {m.num_query_groups} needs --group-query-attention (without it Megatron-LM "
                 "ignores --num-query-groups and builds one key/value group per head); add --group-query-attention "
                 "for grouped-query attention, or drop --num-query-groups")
    _require((problem := unused_moe_flag(config.moe) or unused_deepseek_flag(m)) is None, problem)
    model = TransformerConfig.from_config(config)
    for name in DERIVED_FLAGS:
        setattr(m, name, getattr(model, name))
    config.parallel.sequence_parallel = model.sequence_parallel  # off when TP is 1, as in Megatron
    config.training.recompute_num_layers = model.recompute_num_layers
    for f in dataclasses.fields(config.moe):  # MoE defaults filled in (expert FFN size, coefficient list)
        setattr(config.moe, f.name, getattr(model, f.name))
    from .models.mamba_config import check_hybrid_run
    from .models.spec_plugin import check_spec

    check_hybrid_run(config)  # hybrid Mamba models: the run-level features not built for them
    check_spec(config)  # --spec: importable, a LayerSpec (or layer -> LayerSpec), honouring the flags above


def _translate_moe_layer_recompute(config: Config) -> None:
    """Megatron-LM's deprecated --moe-layer-recompute: selective recomputation with moe added to the
    modules (core_attn by default), as Megatron-LM translates it."""
    t = config.training
    if not config.moe.moe_layer_recompute:
        return
    _require(bool(config.moe.num_experts), "--moe-layer-recompute recomputes MoE layers and this model has none "
             "(no --num-experts); drop it")
    _require(t.recompute_granularity in (None, "selective"), "--moe-layer-recompute means --recompute-granularity "
             "selective --recompute-modules moe, not full; drop one of the two")
    t.recompute_granularity = "selective"
    modules = list(t.recompute_modules or ["core_attn"])
    t.recompute_modules = modules if "moe" in modules else modules + ["moe"]
    config.moe.moe_layer_recompute = False  # translated: the recompute flags hold it from here on


def _check_parallel(config: Config) -> None:
    m, p = config.model, config.parallel
    from .parallel.sharding import check_sharding

    check_sharding(config)
    etp = config.moe.expert_tensor_parallel_size  # as the planner and the converter refuse it for a dense model
    _require(etp is None or bool(config.moe.num_experts), f"--expert-tensor-parallel-size {etp} splits the experts "
             "and this model has none (no --num-experts); drop it")
    _require(p.ddp_bucket_size is None or p.ddp_bucket_size >= 1, "--ddp-bucket-size must be at least 1")
    pp = p.pipeline_model_parallel_size
    _require(pp >= 1, f"--pipeline-model-parallel-size must be at least 1, got {pp}")
    if p.num_layers_per_virtual_pipeline_stage is not None:
        _require(pp >= 2, "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size >= 2")
        per = p.num_layers_per_virtual_pipeline_stage
        _require(per > 0, f"--num-layers-per-virtual-pipeline-stage must be at least 1, got {per}")
        _require(m.num_layers % (per * pp) == 0 or p.account_for_embedding_in_pipeline_split
                 or p.account_for_loss_in_pipeline_split,
                 f"--num-layers {m.num_layers} is not divisible by --num-layers-per-virtual-pipeline-stage {per} "
                 f"x --pipeline-model-parallel-size {pp}")
    elif (p.decoder_first_pipeline_num_layers is None and p.decoder_last_pipeline_num_layers is None
          and p.pipeline_model_parallel_layout is None and not p.account_for_embedding_in_pipeline_split
          and not p.account_for_loss_in_pipeline_split):
        _require(m.num_layers % pp == 0,
                 f"--num-layers {m.num_layers} is not divisible by --pipeline-model-parallel-size {pp}; "
                 "change one or set --decoder-first/last-pipeline-num-layers")
    from .parallel.pipeline.partition import pipeline_ranges

    try:  # the partition itself names the flags when a split does not work out
        ranges = pipeline_ranges(config.flat())
    except ValueError as err:
        raise ConfigError(str(err)) from None
    _check_recompute_num_layers(config, max(end - start for stage in ranges for start, end in stage))


def _check_recompute_num_layers(config: Config, most: int) -> None:
    """--recompute-num-layers counts layers of one model chunk (a pipeline stage, or a virtual stage
    with --num-layers-per-virtual-pipeline-stage), as in Megatron-LM (1 to the layers per chunk):
    a larger value than any chunk holds is a mistake (Megatron-LM's uniform method fails on it)."""
    t = config.training
    n = t.recompute_num_layers
    if t.recompute_granularity != "full" or n is None or n <= most:
        return
    layers = f"{most} layer{'s' if most > 1 else ''}"
    raise ConfigError(f"--recompute-num-layers {n} is more than the {layers} a model chunk holds (a pipeline stage, "
                      f"or a virtual stage with --num-layers-per-virtual-pipeline-stage); use at most {most}")


def _check_batch(config: Config) -> None:
    t, p, dp = config.training, config.parallel, config.data_parallel_size
    _require(t.micro_batch_size > 0, "--micro-batch-size must be positive")
    if t.global_batch_size is None:
        t.global_batch_size = t.micro_batch_size * dp
    _require(t.global_batch_size > 0, f"--global-batch-size must be positive, got {t.global_batch_size}")
    _require(t.decrease_batch_size_if_needed or t.global_batch_size % (t.micro_batch_size * dp) == 0,
             f"--global-batch-size {t.global_batch_size} is not divisible by --micro-batch-size {t.micro_batch_size} "
             f"x data-parallel size {dp}")
    _require(not t.decrease_batch_size_if_needed or t.global_batch_size >= t.micro_batch_size * dp,
             f"--decrease-batch-size-if-needed: --global-batch-size {t.global_batch_size} is less than --micro-batch-size "
             f"{t.micro_batch_size} x data-parallel size {dp}, nothing is left after rounding down")
    from .parallel.pipeline.partition import interleaved

    if interleaved(config.flat()):
        try:
            from .parallel.pipeline.order import check_interleaved_microbatches
            check_interleaved_microbatches(t.global_batch_size // (t.micro_batch_size * dp),
                                           p.pipeline_model_parallel_size)
        except ValueError as err:
            raise ConfigError(str(err)) from None


def _check_precision(pr: PrecisionConfig) -> None:
    from .precision.flags import check_precision_flags

    check_precision_flags(pr)


def _check_profile(config: Config) -> None:
    from .precision.flags import gpu_visible

    t = config.training
    length = ("--train-iters" if t.train_samples is None
              else f"--train-samples {t.train_samples} / --global-batch-size {t.global_batch_size} =")
    check_profile_flags(config.logging, config.world_size, gpu_visible(), t.train_iters, length)


def _check_data_and_checkpoint(config: Config, data_from_script: bool = False) -> None:
    d, t, cp = config.data, config.training, config.checkpoint
    if d.tokenizer_type == "NullTokenizer":
        _require(config.model.vocab_size is not None, "--tokenizer-type NullTokenizer needs --vocab-size")
    elif d.mock_data:  # with a tokenizer's files the mock tokens come from its vocabulary
        _require(d.tokenizer_type is not None or config.model.vocab_size is not None,
                 "--mock-data needs --vocab-size (or --tokenizer-type and its files: the tokens come from its vocabulary)")
    per_split = [f"--{name}-data-path" for name in ("train", "valid", "test") if getattr(d, f"{name}_data_path")]
    if per_split:
        _require(d.data_path is None, f"--data-path and {'/'.join(per_split)} are two ways to give the data: use "
                 "--data-path (one blend split by --split) or the per-split paths (each set whole), not both")
        _require(d.train_data_path is not None, f"{'/'.join(per_split)} need --train-data-path (the training set)")
        _require(not d.sft, f"{'/'.join(per_split)}: --sft reads its conversations from --data-path (split by "
                 "--split); give them there")
        _require(d.split == type(d).__dataclass_fields__["split"].default,  # Megatron-LM refuses it too
                 f"--split {d.split}: {'/'.join(per_split)} give each split its own data, whole, so --split does not "
                 "apply; drop --split (or give --data-path, which --split cuts)")
    given = per_split or (["--data-path"] if d.data_path is not None else [])
    _require(not (d.mock_data and given), f"--mock-data and {'/'.join(given)} are two data sources (random tokens, or "
             "the files; the files would go unread): drop one")  # Megatron-LM: a single data source
    if data_from_script and not d.mock_data and not given:  # the script's provider reads (or makes) the data itself
        _require(d.tokenizer_type is not None or config.model.vocab_size is not None,
                 "this script's datasets provider brings the data; give --vocab-size (or --tokenizer-type and its "
                 "files) for the model's vocabulary")
    elif not d.mock_data:  # also for a script's provider given --data-path: the tokenizer says its EOD and vocabulary
        _require(d.data_path is not None or per_split, "give --data-path (or --mock-data for random tokens)")
        _require(d.tokenizer_type is not None, f"{(per_split or ['--data-path'])[0]} needs --tokenizer-type (and its "
                 "vocab/model files)" + (", also with this script's own datasets provider: the data's end-of-document "
                                         "id and vocabulary come from it (NullTokenizer with --vocab-size N: the ids "
                                         "as stored, EOD N)" if data_from_script else ""))
    _require(d.num_workers >= 0, f"--num-workers must be at least 0, got {d.num_workers} (0: load in the main process)")
    _require(not cp.save_interval or cp.save is not None, "--save-interval needs --save")
    _require(not cp.finetune or cp.load is not None or cp.pretrained_checkpoint is not None,
             "--finetune needs --load (the checkpoint whose weights the run starts from); without it the model "
             "would train from scratch")
    _require(cp.save_interval is None or cp.save_interval >= 0, f"--save-interval must not be negative, got "
             f"{cp.save_interval}; 0 or unset: no periodic save (the run still saves at its end)")
    _require(t.exit_interval is None or t.exit_interval >= 0, f"--exit-interval must not be negative, got "
             f"{t.exit_interval} (it would exit at iteration {-(t.exit_interval or 0)}); 0 or unset: no exit")
    _require(t.exit_duration_in_mins is None or t.exit_duration_in_mins >= 0, "--exit-duration-in-mins must not be "
             f"negative, got {t.exit_duration_in_mins} (it would exit after the first iteration); 0 or unset: no limit")
    _require(not t.exit_signal_handler or cp.save is not None, "--exit-signal-handler needs --save")
    _require(not cp.async_save or cp.ckpt_format == "torch_dist", "--async-save needs --ckpt-format torch_dist")
    check_checkpoint_management(cp)  # --save-retain-interval, non-persistent checkpoints, --ckpt-step
    from .data.sft_dataset import check_sft_flags

    check_sft_flags(config)
    check_lora_flags(config)
    check_upcycling_flags(config)  # --moe-use-upcycling, --moe-upcycling-granularity
    check_validation_flags(config)  # --full-validation, --multiple-validation-sets, --skip-train
