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


def main(argv=None) -> None:
    """lm-eval's own command line (``argv``, default ``sys.argv[1:]``); a bad flag, a bad or unknown
    ``--model_args`` value, a task's ``generation_kwargs`` the backend cannot honour, ``--apply_chat_template``
    without a chat template (ConfigError) or a missing or damaged checkpoint is one line, exit 2."""
    from lm_eval.__main__ import HarnessCLI, setup_logging

    import megatron_lite.inference.lm_eval_backend  # noqa: F401 - registers --model megatron_lite
    from megatron_lite.checkpoint.format import CheckpointError
    from megatron_lite.data.indexed_dataset import DataFileError
    from megatron_lite.errors import ConfigError
    from megatron_lite.inference.cli import fail

    if argv is not None:
        sys.argv = [sys.argv[0]] + list(argv)
    setup_logging()
    _log_to_current_stderr()
    cli = HarnessCLI()
    for parser in [cli._parser, *cli._subparsers.choices.values()]:
        parser.error = _one_line_error(parser)
    try:
        cli.execute(cli.parse_args())
    except (CheckpointError, ConfigError, DataFileError) as err:
        raise SystemExit(fail(err)) from None


def _log_to_current_stderr() -> None:
    """lm-eval sets its log handler up once per process, on the ``sys.stderr`` of that moment; a second
    ``main`` in the same process (after stderr was swapped and closed) would fail on every log line."""
    import logging

    for handler in logging.getLogger("lm_eval").handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
            handler.stream = sys.stderr  # not setStream: it flushes the old stream, which may be closed


def _one_line_error(parser):
    return lambda message: parser.exit(2, f"{parser.prog}: error: {message} (--help lists the flags)\n")


if __name__ == "__main__":
    main()
