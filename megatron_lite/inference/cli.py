"""What every inference tool shares: the checkpoint, layout, precision and tokenizer flags, and
building the engine from them (in one process, or under torchrun with one model over all ranks).

The layout defaults to one process; under torchrun to the checkpoint's own TP x PP when that
uses every rank (else pass ``--tensor-model-parallel-size`` / ``--pipeline-model-parallel-size``).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import torch

from ..checkpoint.dist_read import is_dist_folder, read_common, resolve_folder
from ..checkpoint.format import CheckpointError, checkpoint_config
from ..data.indexed_dataset import DataFileError
from ..data.tokenizers import TOKENIZER_TYPES
from ..errors import ConfigError
from .engine import InferenceEngine
from .loading import TOKENIZER_FIELDS, context_limit, load_model, load_tokenizer
from .speculative import SpeculativeEngine

# The errors a tool reports as one line with exit code 2.
USER_ERRORS = (CheckpointError, ConfigError, DataFileError, ImportError, ValueError)


def fail(err: Exception) -> int:
    """Report a user error in one line: exit code 2 (under torchrun printed once, by rank 0)."""
    from ..errors import exit_with_message

    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        exit_with_message(f"error: {err}", 2)
    import sys

    print(f"error: {err}", file=sys.stderr)
    return 2


def add_inference_args(parser: argparse.ArgumentParser) -> None:
    """--load, the layout, the precision and the tokenizer flags (default: the checkpoint's)."""
    parser.add_argument("--load", required=True, help="checkpoint save folder (latest iteration) or an iter_* folder; "
                        "torch or torch_dist, saved at any layout")
    g = parser.add_argument_group("layout and precision")
    g.add_argument("--tensor-model-parallel-size", type=int, default=None,
                   help="TP size to run at (default: the checkpoint's under torchrun, 1 in one process)")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=None,
                   help="PP size to run at (default: the checkpoint's under torchrun, 1 in one process)")
    g.add_argument("--bf16", action="store_true", help="run in bfloat16")
    g.add_argument("--fp16", action="store_true", help="run in float16")
    g.add_argument("--seed", type=int, default=1234, help="seed of the sampling generator")
    g.add_argument("--max-sequence-length", type=int, default=None,
                   help="longest prompt + generation (default: max-position-embeddings, or seq-length with rope; "
                        "more than max-position-embeddings with learned positions is refused)")
    g.add_argument("--no-kv-cache", action="store_true",
                   help="recompute the whole prefix at every step (slow; for comparisons)")
    t = parser.add_argument_group("tokenizer (default: the flags saved in the checkpoint)")
    t.add_argument("--tokenizer-type", default=None, choices=TOKENIZER_TYPES)
    t.add_argument("--vocab-file", default=None)
    t.add_argument("--merge-file", default=None)
    t.add_argument("--tokenizer-model", default=None)
    t.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer vocabulary size")


@dataclass
class Session:
    """An engine and what the tools need around it."""

    engine: InferenceEngine
    tokenizer: object
    saved: dict
    state: object

    @property
    def is_rank0(self) -> bool:
        return self.state.rank == 0


def saved_layout(path: str) -> tuple[int, int]:
    """(TP, PP) a checkpoint was saved at, read without loading its weights."""
    folder = resolve_folder(path)
    if is_dist_folder(folder):
        layout = read_common(folder).get("layout") or {}
        return int(layout.get("tp", 1)), int(layout.get("pp", 1))
    cfg = checkpoint_config(path)
    return int(cfg.get("tp_size") or 1), int(cfg.get("pp_size") or 1)


def _layout(args, world: int) -> tuple[int, int]:
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if tp is None and pp is None:
        if world == 1:
            return 1, 1
        tp, pp = saved_layout(args.load)
        if tp * pp != world:
            raise ConfigError(f"the checkpoint was saved at TP {tp} x PP {pp} but {world} ranks run here; pass "
                              "--tensor-model-parallel-size and --pipeline-model-parallel-size (product = world size)")
        return tp, pp
    return tp or 1, pp or 1


def _dtype(args) -> torch.dtype:
    if args.bf16 and args.fp16:
        raise ConfigError("--bf16 and --fp16 are exclusive; pick one")
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32


def build_session(args) -> Session:
    """Initialise torch.distributed under torchrun, load this rank's chunk, build the engine and the
    tokenizer. Raises one of :data:`USER_ERRORS` with a one-line message."""
    from ..device import init_distributed
    from ..parallel.state import ParallelState

    if args.max_sequence_length is not None and args.max_sequence_length < 1:
        raise ConfigError(f"--max-sequence-length {args.max_sequence_length} must be at least 1 (or left out: the "
                          "model's context)")
    device = init_distributed()
    world = int(os.environ.get("WORLD_SIZE", 1))
    tp, pp = _layout(args, world)
    state = ParallelState(tp=tp, pp=pp)
    model, saved = load_model(args.load, state, _dtype(args), device, getattr(args, "purpose", "text generation"))
    tokenizer = load_tokenizer(saved, args.load, **{k: getattr(args, k, None) for k in TOKENIZER_FIELDS})
    limit = args.max_sequence_length or context_limit(saved)
    learned = saved.get("position_embedding_type", "learned_absolute") == "learned_absolute"
    if learned and limit > context_limit(saved):  # learned positions end there
        flag = getattr(args, "max_length_flag", "--max-sequence-length")
        raise ConfigError(f"{flag} {limit}: the model has learned positions for {context_limit(saved)} tokens only; "
                          f"pass at most {context_limit(saved)} (or leave it out)")
    kwargs = dict(vocab_size=saved.get("vocab_size") or tokenizer.vocab_size, max_sequence_length=limit,
                  eod=tokenizer.eod, seed=args.seed, use_cache=not args.no_kv_cache, tokenizer=tokenizer)
    speculative = getattr(args, "num_speculative_tokens", None)  # tools/generate.py's and the server's
    if speculative:
        engine = SpeculativeEngine(model, state, num_speculative_tokens=speculative,
                                   fall_back=getattr(args, "speculative_fall_back", False), **kwargs)
    else:
        engine = InferenceEngine(model, state, **kwargs)
    return Session(engine, tokenizer, saved, state)
