"""The ``logging`` section of :class:`~megatron_lite.config.Config`: console lines, TensorBoard and
Weights & Biases (kept apart from config.py, which holds the other sections, to keep files small)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import ConfigError


@dataclass
class LoggingConfig:
    log_interval: int = 100
    """Print a log line every this many steps."""
    tensorboard_dir: str | None = None
    """Write TensorBoard scalars here."""
    log_throughput: bool = False
    """Include TFLOP/s per device in the log line."""
    log_params_norm: bool = False
    """Log the L2 norm of the parameters (each counted once over TP/PP/DP) as "params norm"."""
    log_num_zeros_in_grad: bool = False
    """Log the number of zero entries of the reduced gradients (each parameter once) as "num zeros"."""
    log_comm_volume: bool = False
    """Count the bytes each rank sends per step, per group kind (tp, sp, cp, ep, dp, pp), and log rank 0's."""
    memory_report: bool = False
    """Track live tensors in the first two steps; print each step's peak and remaining bytes by category (parameters, gradients, optimizer state, activations, communication, temporaries) for rank 0 and the rank with the highest peak."""
    wandb_project: str = ""
    """Weights & Biases project: log the TensorBoard scalars there too (optional wandb; WANDB_MODE=offline)."""
    wandb_exp_name: str = ""
    """Weights & Biases run name."""
    wandb_save_dir: str = ""
    """Folder for W&B's local files (default: <save>/wandb, else ./wandb)."""
    no_one_logger: bool = False
    """Accepted for Megatron scripts: it changes nothing, NVIDIA's one-logger is never used."""
    timing_log_level: int = 0
    """Per-phase timers in the log: 0 none, 1 forward-backward/data/grad sync/optimizer, 2 also finer phases."""
    log_timers_to_tensorboard: bool = False
    """Also write the timers as <name>-time scalars (ms) to TensorBoard and W&B."""
    profile: bool = False
    """Profile iterations --profile-step-start+1 .. --profile-step-end (Nsight Systems, or --use-pytorch-profiler)."""
    use_pytorch_profiler: bool = False
    """With --profile: torch.profiler, writing a TensorBoard/Perfetto trace to --tensorboard-dir (or ./profile)."""
    profile_step_start: int = 10
    """Iterations completed when profiling starts."""
    profile_step_end: int = 12
    """Iterations completed when profiling stops."""
    profile_ranks: list[int] | None = field(default_factory=lambda: [0])
    """Global ranks to profile."""
    tensorboard_log_interval: int = 1
    """Write the per-iteration TensorBoard / W&B scalars every this many iterations."""
    tensorboard_queue_size: int = 1000
    """TensorBoard events held in memory before a write forces them to disk."""
    log_learning_rate_to_tensorboard: bool = True
    """Write learning-rate to TensorBoard / W&B (--no-log-learning-rate-to-tensorboard: not)."""
    log_loss_scale_to_tensorboard: bool = True
    """Write loss-scale to TensorBoard / W&B (--no-log-loss-scale-to-tensorboard: not)."""
    log_batch_size_to_tensorboard: bool = False
    """Write batch-size to TensorBoard / W&B."""
    log_world_size_to_tensorboard: bool = False
    """Write world-size to TensorBoard / W&B."""
    log_memory_to_tensorboard: bool = False
    """Write memory scalars every TensorBoard interval: on a GPU mem-reserved-bytes, mem-allocated-bytes, mem-max-allocated-bytes, mem-allocated-count; on the CPU mem-rss-bytes and mem-max-rss-bytes."""
    log_validation_ppl_to_tensorboard: bool = False
    """Write "<loss> validation ppl" (the perplexity) next to each validation loss."""
    log_straggler: bool = False
    """Straggler detector: time each rank's forward/backward compute; every --log-interval rank 0 prints the slowest and fastest ranks (time per iteration, TFLOP/s) and the max/min ratio."""
    disable_straggler_on_startup: bool = False
    """With --log-straggler: start with the detector off (switch it on through --straggler-ctrlr-port)."""
    straggler_ctrlr_port: int = 65535
    """With --log-straggler: rank 0 serves HTTP on this port; any GET (curl <rank 0 host>:<port>) switches the detector on or off from the next report."""
    straggler_minmax_count: int = 1
    """With --log-straggler: how many of the slowest and of the fastest ranks each report names."""
    log_progress: bool = False
    """Append progress lines (iteration, job and cumulative TFLOP/s/GPU, floating-point operations, tokens so far) to <save>/progress.txt at start-up and each checkpoint save."""


def check_logging_flags(logging, save: str | None) -> None:
    """Raise ConfigError (one line naming the flag) for a TensorBoard interval / queue below 1, or
    --log-progress without --save (its file lives in the save folder)."""
    for flag, value in (("--tensorboard-log-interval", logging.tensorboard_log_interval),
                        ("--tensorboard-queue-size", logging.tensorboard_queue_size)):
        if value < 1:
            raise ConfigError(f"{flag} must be at least 1, got {value}")
    if logging.log_progress and not save:
        raise ConfigError("--log-progress writes <save>/progress.txt: add --save DIR or drop --log-progress")
    check_straggler_flags(logging)


def check_straggler_flags(logging) -> None:
    """The straggler detector's flags: a count of at least 1, a TCP port, none of them without --log-straggler."""
    if logging.straggler_minmax_count < 1:
        raise ConfigError(f"--straggler-minmax-count must be at least 1, got {logging.straggler_minmax_count}")
    if not 1 <= logging.straggler_ctrlr_port <= 65535:
        raise ConfigError(f"--straggler-ctrlr-port must be a TCP port (1-65535), got {logging.straggler_ctrlr_port}")
    if not logging.log_straggler:
        given = [flag for flag, on in (("--disable-straggler-on-startup", logging.disable_straggler_on_startup),
                                       ("--straggler-ctrlr-port", logging.straggler_ctrlr_port != 65535),
                                       ("--straggler-minmax-count", logging.straggler_minmax_count != 1)) if on]
        if given:
            raise ConfigError(f"{given[0]} configures the straggler detector, which is off: add --log-straggler "
                              f"or drop {given[0]}")


def check_profile_flags(logging, world_size: int, gpu: bool, train_iters: int | None = None,
                        length_flag: str = "--train-iters") -> None:
    """Raise ConfigError (one line naming the flag) for a profiling combination that cannot work
    (``train_iters``: the run's iterations, which the window must start before; ``length_flag``: the
    flag that set them, as the user wrote it)."""
    if not logging.profile:
        return
    if not 0 <= logging.profile_step_start < logging.profile_step_end:
        raise ConfigError(f"--profile needs 0 <= --profile-step-start ({logging.profile_step_start}) < "
                          f"--profile-step-end ({logging.profile_step_end})")
    if train_iters is not None and logging.profile_step_start >= train_iters:
        raise ConfigError(f"--profile: --profile-step-start {logging.profile_step_start} is not below "
                          f"{length_flag} {train_iters}, so no iteration would be profiled; set --profile-step-start "
                          "and --profile-step-end inside the run")
    bad = [r for r in logging.profile_ranks or [] if not 0 <= r < world_size]
    if bad:
        raise ConfigError(f"--profile-ranks {' '.join(map(str, bad))}: not a rank of this run (world size {world_size})")
    if not logging.use_pytorch_profiler and not gpu:
        raise ConfigError("--profile without --use-pytorch-profiler drives Nsight Systems through the CUDA profiler "
                          "API, which needs a GPU; add --use-pytorch-profiler")
