"""Convert checkpoints (GPT, BERT, MoE): change the tensor/pipeline/expert layout, export to or import
from Hugging Face (GPT-2, Llama, Mixtral, gpt-oss, Megatron-BERT, DeepSeek-V3).

Megatron-LM's interface; the loader and saver plugins live in :mod:`megatron_lite.checkpoint.convert`.

    # TP2 x PP2 training checkpoint -> TP4 x PP1
    python tools/checkpoint/convert.py --model-type GPT --loader megatron --saver megatron \
        --load-dir ckpt/gpt --save-dir ckpt/gpt_tp4 --target-tensor-parallel-size 4 --target-pipeline-parallel-size 1
    # mixture of experts: EP2 x TP2 -> EP4 x TP1 (experts, router, shared experts, optimizer state)
    python tools/checkpoint/convert.py --model-type GPT --load-dir ckpt/moe --save-dir ckpt/moe_ep4 \
        --target-expert-parallel-size 4 --target-tensor-parallel-size 1
    # export for evaluation harnesses (transformers / safetensors; MoE models as Mixtral or gpt-oss, MLA / MTP as DeepSeek-V3)
    python tools/checkpoint/convert.py --model-type GPT --loader megatron --saver hf --load-dir ckpt/gpt --save-dir hf/gpt
    # import a Llama-style model to continue pretraining at TP2
    python tools/checkpoint/convert.py --model-type GPT --loader hf --saver megatron --load-dir hf/llama \
        --save-dir ckpt/llama --target-tensor-parallel-size 2
    # import DeepSeek-V3 (MLA, MoE, MTP) at TP2 x PP4 x EP8 with grouped-GEMM experts
    python tools/checkpoint/convert.py --model-type GPT --loader hf --saver megatron --load-dir hf/dsv3 \
        --save-dir ckpt/dsv3 --target-tensor-parallel-size 2 --target-pipeline-parallel-size 4 \
        --target-expert-parallel-size 8 --moe-grouped-gemm

Exit code 2 with one line on stderr for a bad option or a checkpoint that cannot be converted; Ctrl-C
(130) or SIGTERM (143) leave nothing half-written.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron_lite.checkpoint.convert import build_parser, convert  # noqa: E402
from megatron_lite.checkpoint.format import CheckpointError  # noqa: E402
from megatron_lite.data.interrupt import interrupted_exit_code, terminate_as_interrupt  # noqa: E402
from megatron_lite.errors import ConfigError, run_tool  # noqa: E402
from megatron_lite.progress import progress  # noqa: E402


def _progress(iterable, **kw):
    return progress(iterable, **kw)  # a bar on a terminal, plain lines in a log file


def _os_error(err: OSError, args) -> str:
    """One line for an OSError: which folder it concerns (``--load-dir`` or ``--save-dir``) and the fix."""
    where = os.path.abspath(str(err.filename or ""))
    reason = f"{err.strerror or err} ({err.filename})" if err.filename else str(err.strerror or err)
    def under(folder):
        return os.path.commonpath([where, os.path.abspath(folder)]) == os.path.abspath(folder)

    if under(args.load_dir) and not under(args.save_dir):
        return f"could not read --load-dir {args.load_dir}: {reason}"
    return (f"could not write --save-dir {args.save_dir}: {reason}; point --save-dir at a new folder you can "
            "write to, on a disk with room for the checkpoint")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with terminate_as_interrupt():  # kill / a scheduler's SIGTERM cleans up like Ctrl-C
            out = convert(args, progress=_progress)
    except KeyboardInterrupt as err:  # the savers stage their files: nothing half-written is left
        print(f"interrupted: nothing half-written is left in --save-dir {args.save_dir}", file=sys.stderr)
        return interrupted_exit_code(err)
    except (ConfigError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a file in the way, no permission, disk full: one line, not a traceback
        print(f"error: {_os_error(err, args)}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
