"""Context-parallel flags with Megatron-LM's names and rules: --context-parallel-size, --cp-comm-type
(p2p, a2a, allgather or a2a+p2p; one for every layer, or one per layer) and
--hierarchical-context-parallel-sizes (a2a+p2p's all-to-all and ring sizes), checked against the
model's sequence length and heads. The attention itself: :mod:`megatron_lite.parallel.context`."""

from __future__ import annotations

from ..errors import ConfigError
from ..parallel.context import CP_COMM_TYPES


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def check_hierarchical_cp(cfg, types: list[str]) -> None:
    """--hierarchical-context-parallel-sizes A B: two positive sizes whose product is the CP size
    (Megatron-LM's rule); a2a+p2p needs them, and the (TP-local) query heads and key/value groups
    divisible by A (the all-to-all splits heads over A ranks). Given without a2a+p2p they would
    change nothing (Megatron-LM ignores them): refused."""
    sizes, cp, tp = cfg.hierarchical_context_parallel_sizes, cfg.context_parallel_size, cfg.tensor_model_parallel_size
    _require(sizes is not None or "a2a+p2p" not in types,
             f"--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A B with A x B = "
             f"--context-parallel-size {cp}")
    if sizes is None:
        return
    _require("a2a+p2p" in types,
             f"--hierarchical-context-parallel-sizes only applies with --cp-comm-type a2a+p2p (this run's "
             f"{' '.join(types)} does not use it); add a2a+p2p, or drop --hierarchical-context-parallel-sizes")
    _require(len(sizes) == 2 and all(n >= 1 for n in sizes) and sizes[0] * sizes[1] == cp,
             f"--hierarchical-context-parallel-sizes {' '.join(map(str, sizes))}: give two positive sizes "
             f"A B (all-to-all, ring) with A x B = --context-parallel-size {cp}")
    for flag, value in (("num-attention-heads", cfg.num_attention_heads), ("num-query-groups", cfg.num_query_groups)):
        _require(value % (tp * sizes[0]) == 0,
                 f"--cp-comm-type a2a+p2p needs --{flag} {value} divisible by --tensor-model-parallel-size {tp} x "
                 f"the all-to-all size {sizes[0]} (--hierarchical-context-parallel-sizes); change A or the heads")


def check_context_parallel_fields(cfg) -> None:
    """--context-parallel-size, --cp-comm-type (one type, or one per layer) and the hierarchical sizes
    against the model's sequence length and heads (a TransformerConfig, after its derived sizes)."""
    cp, tp = cfg.context_parallel_size, cfg.tensor_model_parallel_size
    _require(cp >= 1, "--context-parallel-size must be at least 1")
    types = [cfg.cp_comm_type] if isinstance(cfg.cp_comm_type, str) else list(cfg.cp_comm_type)
    _require(len(types) in (1, cfg.num_layers),
             f"--cp-comm-type takes one value or one per layer ({cfg.num_layers}), got {len(types)}")
    for kind in types:
        _require(kind in CP_COMM_TYPES, f"--cp-comm-type {kind!r} is not supported; use one of "
                 f"{', '.join(CP_COMM_TYPES)}")
    check_hierarchical_cp(cfg, types)
    if cp == 1:
        return
    _require(cfg.seq_length % (2 * cp) == 0,
             f"--context-parallel-size {cp} needs --seq-length {cfg.seq_length} divisible by 2 x cp = {2 * cp}")
    _require(not cfg.sequence_parallel or cfg.seq_length // cp % tp == 0,  # a rank's tokens, cut over TP
             f"--sequence-parallel with --context-parallel-size {cp} needs --seq-length {cfg.seq_length} / cp = "
             f"{cfg.seq_length // cp} divisible by --tensor-model-parallel-size {tp}")
    if "a2a" in types:
        for flag, value in (("num-attention-heads", cfg.num_attention_heads),
                            ("num-query-groups", cfg.num_query_groups)):
            _require(value % (tp * cp) == 0,
                     f"--cp-comm-type a2a needs --{flag} {value} divisible by --tensor-model-parallel-size {tp} "
                     f"x --context-parallel-size {cp}; use p2p or allgather")
