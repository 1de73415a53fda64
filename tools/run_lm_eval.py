"""lm-evaluation-harness's command line with the ``megatron_lite`` model backend registered.

lm-eval finds models by name in its registry and has no plugin discovery, so this wrapper imports
the backend (:mod:`megatron_lite.inference.lm_eval_backend`) and then runs ``lm_eval`` with the same
arguments. (Not named lm_eval.py: a script of that name would shadow the lm_eval package.) See
docs/inference.md.

    python tools/run_lm_eval.py --model megatron_lite --model_args load=checkpoints/gpt --tasks lambada_openai
    python tools/run_lm_eval.py --model megatron_lite --model_args load=ckpt,batch_size=32 \
        --tasks my_task --include_path my_tasks/
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    from lm_eval.__main__ import cli_evaluate

    import megatron_lite.inference.lm_eval_backend  # noqa: F401 - registers --model megatron_lite

    cli_evaluate()


if __name__ == "__main__":
    main()
