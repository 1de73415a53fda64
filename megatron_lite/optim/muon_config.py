"""The Muon flags (Megatron-LM's names and defaults), a mixin of the optimizer section, and their checks.

``--optimizer muon`` steps the 2-D weights of the linear layers with Muon (:mod:`megatron_lite.optim.muon`)
and everything else (embeddings, output layer, norms, biases) with AdamW and the ``--adam-*`` flags.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

MUON_SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
MUON_TP_MODES = ("blockwise", "duplicated", "distributed")
MUON_MATMUL_PRECISIONS = ("low", "medium", "high")
MUON_CHOICES = {
    "muon_scale_mode": list(MUON_SCALE_MODES),
    "muon_tp_mode": list(MUON_TP_MODES),
    "muon_fp32_matmul_prec": list(MUON_MATMUL_PRECISIONS),
}


@dataclass
class MuonConfig:
    muon_momentum: float = 0.9
    """With --optimizer muon: the momentum of Muon's buffer (an average: buffer = m x buffer + (1 - m) x gradient)."""
    muon_use_nesterov: bool = False
    """With --optimizer muon: Nesterov momentum (orthogonalise the gradient moved towards the buffer by --muon-momentum)."""
    muon_no_split_qkv: bool = False
    """With --optimizer muon: orthogonalise the fused query/key/value weight whole instead of its Q, K and V parts apart."""
    muon_scale_mode: str = "spectral"
    """With --optimizer muon: the factor on the orthogonalised update of an out x in matrix: spectral sqrt(max(out, in)), unit_rms_norm sqrt(out / in), shape_scaling sqrt(max(1, out / in))."""
    muon_fp32_matmul_prec: str = "medium"
    """With --optimizer muon: the Newton-Schulz iteration's precision: low and medium compute it in bf16, high in fp32 (TF32 allowed on GPUs)."""
    muon_num_ns_steps: int = 5
    """With --optimizer muon: Newton-Schulz steps (the quintic coefficients, repeated after 5)."""
    muon_tp_mode: str = "blockwise"
    """With --optimizer muon: a tensor-parallel matrix is orthogonalised per rank's block (blockwise), whole after an all-gather (duplicated), or whole with an all-reduced Gram matrix (distributed)."""
    muon_extra_scale_factor: float = 1.0
    """With --optimizer muon: one more factor on every Muon update, at least 0 (Moonlight uses 0.2 with the spectral scale)."""


def check_muon_flags(config) -> None:
    """--optimizer muon's values and what it does not run with; ConfigError with one line."""
    o, p = config.optim, config.parallel
    if o.optimizer != "muon":
        return
    if not 0 <= o.muon_momentum < 1:
        raise ConfigError(f"--muon-momentum must be in [0, 1), got {o.muon_momentum}")
    if o.muon_num_ns_steps < 1:
        raise ConfigError(f"--muon-num-ns-steps must be at least 1, got {o.muon_num_ns_steps}")
    if o.muon_extra_scale_factor < 0:  # 0 leaves the matrices as they are (only AdamW's tensors train)
        raise ConfigError(f"--muon-extra-scale-factor must not be negative (it would step the matrices uphill), "
                          f"got {o.muon_extra_scale_factor}; Moonlight's recipe is 0.2")
    for flag, beta in (("--adam-beta1", o.adam_beta1), ("--adam-beta2", o.adam_beta2)):
        if not 0 <= beta < 1:  # the AdamW part (embeddings, output layer, norms, biases)
            raise ConfigError(f"{flag} must be in [0, 1), got {beta}")
    if o.adam_eps <= 0:
        raise ConfigError(f"--adam-eps must be positive, got {o.adam_eps}")
    if p.use_distributed_optimizer or p.data_parallel_sharding_strategy != "no_shard":
        raise ConfigError(f"--optimizer muon with a sharded optimizer (--use-distributed-optimizer, "
                          f"--data-parallel-sharding-strategy {p.data_parallel_sharding_strategy}): Muon needs whole "
                          "matrices on the rank that steps them and the sharded optimizer cuts them into flat ranges "
                          "(as in Megatron-LM); drop both flags")
    if o.optimizer_cpu_offload:
        raise ConfigError("--optimizer muon with --optimizer-cpu-offload: the CPU-offloaded step is AdamW's only; "
                          "drop --optimizer-cpu-offload")
