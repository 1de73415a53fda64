"""The result-validation flags (``--rerun-mode``, ``--check-for-spiky-loss``, ``--check-for-large-grads``,
``--error-injection-*``, ``--iterations-to-skip``, ``--check-weight-hash-across-dp-replicas-interval``): their choices and refusals, without importing the
training code (the argument parser imports this). What they do: :mod:`megatron_lite.training.rerun`."""

from __future__ import annotations

from ..errors import ConfigError

RERUN_MODES = ("disabled", "validate_results", "report_stats")  # Megatron-LM's choices
ERROR_INJECTION_TYPES = ("correct_result", "transient_error", "persistent_error")


def check_rerun_flags(config) -> None:
    """The result-validation flags' refusals (one ConfigError line naming the flag)."""
    t = config.training
    if t.rerun_mode == "report_stats":
        raise ConfigError("--rerun-mode report_stats (Megatron-LM's statistics of the variability of rerun "
                          "results) is not built; use --rerun-mode validate_results (the default) or disabled")
    if t.error_injection_rate < 0:
        raise ConfigError(f"--error-injection-rate must be at least 0 (0: no injection), got {t.error_injection_rate}")
    if any(i < 0 for i in t.iterations_to_skip):
        raise ConfigError(f"--iterations-to-skip counts iterations from 0; got {t.iterations_to_skip}")
    asked = [flag for flag, on in (("--check-for-spiky-loss", t.check_for_spiky_loss),
                                   ("--check-for-large-grads", t.check_for_large_grads),
                                   ("--error-injection-rate", t.error_injection_rate > 0)) if on]
    if asked and t.rerun_mode != "validate_results":
        raise ConfigError(f"{asked[0]} needs --rerun-mode validate_results (the default); with --rerun-mode "
                          f"{t.rerun_mode} results are not rerun")
    checks = t.check_for_nan_in_loss_and_grad or t.check_for_spiky_loss or t.check_for_large_grads
    if t.error_injection_rate > 0 and not checks:
        raise ConfigError("--error-injection-rate fails a result check on purpose, and no check is on: keep "
                          "--check-for-nan-in-loss-and-grad (the default) or add --check-for-spiky-loss")
    _check_weight_hash_flag(config)
    if asked and config.moe.num_experts:
        raise ConfigError(f"{asked[0]} with --num-experts is not built (a rerun step that is trained on would "
                          "count the routers' token statistics twice); drop it")


def _check_weight_hash_flag(config) -> None:
    interval = config.training.check_weight_hash_across_dp_replicas_interval
    if interval is None:
        return
    if interval <= 0:
        raise ConfigError(f"--check-weight-hash-across-dp-replicas-interval must be at least 1 (iterations between "
                          f"checks), got {interval}")
    if config.parallel.data_parallel_sharding_strategy == "optim_grads_params":
        raise ConfigError("--check-weight-hash-across-dp-replicas-interval with --data-parallel-sharding-strategy "
                          "optim_grads_params (ZeRO-3): each data-parallel rank holds another shard of the weights, there "
                          "is no replica to compare; drop it or use optim_grads (ZeRO-2), whose weights are replicated")
