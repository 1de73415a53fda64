"""The example scripts run by hand rather than as a launch (not in test_launch_scripts.SCRIPTS, which
have a check mode): quickstart_cpu.sh, the README's first command, and mixtral_gpu.sh. Each Python
command's flags are validated as the docs' commands are (tests/doc_blocks.py: training flags for the
world size torchrun gives, with MEGATRON_LITE_CHECK_ARGS=1; the tools' flags by their parsers)."""

import os
import re

import pytest

from tests.unit.test_launch_scripts import EXAMPLES

# The shell variables each script uses, as its defaults give them (the others as a user would set them).
BY_HAND = {
    "quickstart_cpu.sh": {"OUT": "outputs/quickstart", "ITERS": "300", "WARMUP": "20"},  # the README's main command
    "mixtral_gpu.sh": {"GPUS": "8", "DATA": "data/corpus_text_document", "TOKENIZER": "data/spm.model",
                       "SHAPE[@]": "--num-layers 8 --hidden-size 2048 --moe-ffn-hidden-size 5632 --ffn-hidden-size 5632 "
                                   "--num-attention-heads 16 --num-query-groups 4 --seq-length 2048"},
}


def _commands_of(script: str):
    """(script, args, world size) of every Python command of ``examples/<script>``, its variables expanded."""
    from tests.doc_blocks import Block, commands, script_and_args

    values = BY_HAND[script]
    text = open(os.path.join(EXAMPLES, script)).read().replace("python3 -m torch.distributed.run", "torchrun")

    def value(m):
        name, default = m.group(1) or m.group(3), m.group(2)
        return values.get(name, default if default is not None else m.group(0))

    text = re.sub(r'"\$\{(\w+\[@\])\}"', lambda m: values[m.group(1)], text)  # an array: several words
    text = re.sub(r"\$\{(\w+?)(?::-([^}]*))?\}|\$(\w+)", value, text)
    found = [script_and_args(c) for c in commands(Block(script, 1, text, "check"))]
    return [f for f in found if f[0] and (f[0].startswith("tools/") or f[0].startswith("pretrain_"))]


@pytest.mark.parametrize("script, expected", [
    ("quickstart_cpu.sh", ["tools/make_sample_corpus.py", "tools/train_tokenizer.py", "tools/preprocess_data.py",
                           "pretrain_gpt.py", "tools/generate.py", "tools/plot_loss.py"]),
    ("mixtral_gpu.sh", ["pretrain_gpt.py"]),
])
def test_hand_run_scripts_take_valid_flags(script, expected):
    """quickstart_cpu.sh (README: 'bash examples/quickstart_cpu.sh') and mixtral_gpu.sh are not launch
    scripts with a check mode, and no test read them: a renamed flag would have broken the README's
    first command unnoticed. Each Python command's flags are validated as the docs' commands are
    (training flags for the world size torchrun gives, MEGATRON_LITE_CHECK_ARGS=1)."""
    from tests.doc_blocks import check_flags

    found = _commands_of(script)
    assert [f[0] for f in found] == expected
    problems = [check_flags(name, args, world, placeholders=False) for name, args, world in found]
    assert not [p for p in problems if p], problems
    if script == "quickstart_cpu.sh":  # what the README says it trains
        name, args, world = found[3]
        assert world == 4 and " ".join(args).startswith("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
                                                        "--sequence-parallel --num-layers 4 --hidden-size 128")
