"""tools/generate.py's sampling flags as docs/inference.md promises them: `--temperature 0` and
`--top-k 1` take the most likely token as `--greedy` does; `--top-k` with `--top-p` is refused in one
line (exit 2); `--log-probs` prints every token after the first, prompt tokens included, with
`log p(token | everything before it)`."""

import pytest

from megatron_lite.inference.engine import InferenceEngine
from megatron_lite.inference.loading import load_model
from megatron_lite.inference.sampling import SamplingParams
from tests.inference_helpers import MAX_LEN, VOCAB, prompts, save_model
from tests.tools import load_tool

NEW = 8


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("generate") / "gpt")
    save_model("gpt", root)
    return root, load_model(root)[0]  # as loaded (its config's fusions on), the model generate.py runs


def _run(gen, capsys, root, prompt, *flags):
    argv = ["--load", root, "--prompt", " ".join(map(str, prompt)), "--max-new-tokens", str(NEW), *flags]
    assert gen.main(argv) == 0
    return capsys.readouterr().out


def test_temperature_zero_and_top_k_one_are_greedy(ckpt, capsys):
    root, model = ckpt
    gen, prompt = load_tool("generate"), prompts(1)[0]
    engine = InferenceEngine(model, vocab_size=VOCAB, max_sequence_length=MAX_LEN, eod=VOCAB - 1)
    want = engine.generate([prompt], SamplingParams(tokens_to_generate=NEW, top_k=1))[0].tokens
    greedy = _run(gen, capsys, root, prompt, "--greedy")
    assert [int(t) for t in greedy.split()] == want
    sampled = {_run(gen, capsys, root, prompt, "--seed", str(seed)) for seed in (1, 2, 3)}
    assert sampled - {greedy}, "temperature 1 must draw other texts than greedy here, or the test proves nothing"
    assert _run(gen, capsys, root, prompt, "--temperature", "0", "--seed", "1") == greedy
    assert _run(gen, capsys, root, prompt, "--top-k", "1", "--seed", "1") == greedy


def test_top_k_with_top_p_is_one_line_exit_2(ckpt, capsys):
    argv = ["--load", ckpt[0], "--prompt", "1 2 3", "--top-k", "5", "--top-p", "0.9"]
    assert load_tool("generate").main(argv) == 2
    err = capsys.readouterr().err
    assert err == "error: cannot set both top_k and top_p; use one of them\n"


def test_log_probs_print_every_token_after_the_first_prompt_included(ckpt, capsys):
    root, model = ckpt
    prompt = prompts(1)[0]
    out = _run(load_tool("generate"), capsys, root, prompt, "--greedy", "--log-probs").splitlines()
    tokens = [int(t) for t in out[0].split()]
    scored = [(int(line.split()[0]), float(line.split()[1])) for line in out[1:]]
    assert [t for t, _ in scored] == tokens[1:] and len(tokens) == len(prompt) + NEW
    engine = InferenceEngine(model, vocab_size=VOCAB, max_sequence_length=MAX_LEN, eod=VOCAB - 1)
    want = engine.generate([prompt], SamplingParams(tokens_to_generate=NEW, top_k=1))[0]
    assert len(want.log_probs) == len(tokens) - 1
    assert all(abs(a - b) <= 6e-5 for (_, a), b in zip(scored, want.log_probs))


def test_the_context_is_max_position_embeddings_with_learned_positions_else_seq_length():
    """docs/inference.md: the longest prompt + generation is --max-position-embeddings (learned
    positions) or --seq-length (rotary); the test models set both equal, where a swap could not show."""
    from megatron_lite.inference.loading import context_limit

    saved = {"max_position_embeddings": 128, "seq_length": 64}
    assert context_limit({**saved, "position_embedding_type": "learned_absolute"}) == 128
    assert context_limit(saved) == 128  # learned positions are the default
    assert context_limit({**saved, "position_embedding_type": "rope"}) == 64


@pytest.mark.parametrize("flag, dtype", [([], "float32"), (["--bf16"], "bfloat16"), (["--fp16"], "float16")])
def test_bf16_and_fp16_run_the_model_in_half_precision(ckpt, capsys, flag, dtype):
    """docs/inference.md: --bf16 / --fp16 run in half precision (default fp32); both at once is one line."""
    import torch

    from megatron_lite.inference.cli import build_session

    gen = load_tool("generate")
    session = build_session(gen.parse_args(["--load", ckpt[0], *flag]))
    assert {p.dtype for p in session.engine.model.parameters()} == {getattr(torch, dtype)}
    assert gen.main(["--load", ckpt[0], "--prompt", "1 2 3", "--max-new-tokens", "3", "--greedy", *flag]) == 0
    assert len(capsys.readouterr().out.split()) == 6


def test_bf16_with_fp16_is_one_line_exit_2(ckpt, capsys):
    assert load_tool("generate").main(["--load", ckpt[0], "--prompt", "1", "--bf16", "--fp16"]) == 2
    assert capsys.readouterr().err == "error: --bf16 and --fp16 are exclusive; pick one\n"
