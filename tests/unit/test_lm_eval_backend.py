"""The lm-eval backend's edge cases, against what lm-eval's ``hf`` backend returns for them: a
continuation that tokenizes to nothing (BPE merges it into the context's last token) scores
``(0.0, True)``, not the whole context; a batch size below 1 is refused before loading; chat
templates (``--apply_chat_template``) render, tokenize, score and generate as hf, and a tokenizer
without one is refused in one line."""

import functools
import os
import re

import pytest

from tests.inference_helpers import GPT2_TOKENIZER, save_model

pytest.importorskip("lm_eval")


FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "lm_eval")
# A Llama-style template: the BOS's text first (the tokenizer adds a BOS too: it must not come twice)
CHAT = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }} {{ m['content'] }}"
        "{% if m['role'] != 'system' %} </s>{% endif %} {% endfor %}{% if add_generation_prompt %}assistant {% endif %}")


@pytest.fixture(scope="module")
def gpt2_ckpt(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("lm_eval_backend") / "ckpt")
    save_model("gpt", root, tokenizer=GPT2_TOKENIZER)
    return root


@pytest.fixture(scope="module")
def lm(gpt2_ckpt):
    from megatron_lite.inference.lm_eval_backend import MegatronLiteLM

    return MegatronLiteLM(load=gpt2_ckpt, batch_size=2)


def test_a_continuation_merged_into_the_context_scores_zero_like_hf(lm):
    from lm_eval.api.instance import Instance

    # GPT-2 BPE: "Hello wor" + "ld" is "Hello world", two tokens like "Hello wor": no continuation token
    assert len(lm.tok_encode("Hello world")) == len(lm.tok_encode("Hello wor"))
    requests = [Instance("loglikelihood", {}, (ctx, cont), 0)
                for ctx, cont in [("Hello wor", "ld"), ("Hello", " world"), ("The cat", "s")]]
    merged, normal, merged_too = lm.loglikelihood(requests, disable_tqdm=True)
    assert merged == (0.0, True) and merged_too == (0.0, True)
    assert normal[0] < 0.0  # a real continuation token is still scored
    assert lm._loglikelihood_tokens([(None, [15496, 995], [])], disable_tqdm=True) == [(0.0, True)]


def test_a_continuation_longer_than_the_context_is_refused_not_scored_in_part(lm):
    from megatron_lite.errors import ConfigError

    fits = [1] * lm.max_length  # the window holds max_length + 1 tokens: every continuation token is predicted
    assert len(lm._loglikelihood_tokens([(None, [2], fits)], disable_tqdm=True)) == 1
    with pytest.raises(ConfigError, match=f"continuation is {lm.max_length + 1} tokens, longer than the model's "
                                          f"context max_length {lm.max_length}"):
        lm._loglikelihood_tokens([(None, [2], fits + [1])], disable_tqdm=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_the_dtype_model_arg_loads_the_model_in_that_dtype(gpt2_ckpt, dtype):
    """docs/inference.md: --model_args dtype (float32, bfloat16, float16)."""
    import torch

    from megatron_lite.inference.lm_eval_backend import MegatronLiteLM

    lm = MegatronLiteLM(load=gpt2_ckpt, dtype=dtype)
    assert {p.dtype for p in lm.engine.model.parameters()} == {getattr(torch, dtype)}


def test_a_long_context_is_cut_on_the_left_for_scoring_and_generation(lm):
    """docs/inference.md: a loglikelihood context longer than the model's context is cut on the left (as
    hf): it scores as its last tokens alone; generate_until keeps the last max_length - max_gen_toks."""
    from types import SimpleNamespace

    ctx, cont = [(7 * i) % 5000 + 10 for i in range(150)], [11, 12, 13]
    keep = lm.max_length + 1 - len(cont)
    (long, _), (short, _) = lm._loglikelihood_tokens([(None, ctx, cont), (None, ctx[-keep:], cont)])
    assert long == short
    (cut, _), = lm._loglikelihood_tokens([(None, ctx[-keep + 1:], cont)])
    assert cut != long  # one token less of context changes the score: the test could see a wrong cut
    text = lm.tok_decode(ctx)
    ids = lm.tok_encode(text)
    assert len(ids) > lm.max_length
    got = lm.generate_until([SimpleNamespace(args=(text, {"until": [], "max_gen_toks": 5}))], disable_tqdm=True)[0]
    params, _ = lm._params({"until": [], "max_gen_toks": 5})
    want = lm.engine.generate([ids[-(lm.max_length - 5):]], params)[0].generated
    assert got == lm._decode_generated(want)


def test_a_long_text_is_scored_in_rolling_windows_whose_sums_add_up(lm):
    """loglikelihood_rolling: a text of more than max_length tokens is scored in lm-eval's disjoint windows
    (its get_rolling_token_windows), each with its own context, and the text's total is the sum of every
    window's (a short text batched with it keeps its own, one-window total)."""
    from lm_eval import utils as lm_utils
    from lm_eval.api.instance import Instance

    long_text = lm.tok_decode([(7 * i) % 5000 + 10 for i in range(2 * lm.max_length + 30)])
    ids = lm.tok_encode(long_text)
    windows = list(map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
        token_list=ids, prefix_token=lm.prefix_token_id, max_seq_len=lm.max_length, context_len=1)))
    assert len(windows) == 3 and sum(len(target) for _, target in windows) == len(ids)
    want = sum(lm._loglikelihood_tokens([(None, context, target)])[0][0] for context, target in windows)
    short = Instance("loglikelihood_rolling", {}, ("one two three",), 1)
    (alone,) = lm.loglikelihood_rolling([short], disable_tqdm=True)
    got = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (long_text,), 0), short], disable_tqdm=True)
    assert got == pytest.approx([want, alone], rel=1e-5, abs=1e-5)


def test_a_batch_size_below_one_is_refused():
    from megatron_lite.errors import ConfigError
    from megatron_lite.inference.lm_eval_backend import MegatronLiteLM

    with pytest.raises(ConfigError, match="^--model_args batch_size=0: use a whole number >= 1"):
        MegatronLiteLM(load="/nonexistent", batch_size=0)


def test_a_batch_size_in_model_args_wins_over_the_one_lm_eval_always_passes(gpt2_ckpt):
    """lm-eval's command line always passes its --batch_size (default 1) and --device (default cuda:0)
    beside --model_args: batch_size=3 in --model_args (as the docs show) was 'got multiple values for
    keyword argument' (a traceback); it now wins, and --batch_size alone still applies; auto is 16."""
    from megatron_lite.inference.lm_eval_backend import MegatronLiteLM

    cli = {"batch_size": 1, "max_batch_size": None, "device": "cuda:0"}
    assert MegatronLiteLM.create_from_arg_string(f"load={gpt2_ckpt},batch_size=3", dict(cli)).batch_size == 3
    assert MegatronLiteLM.create_from_arg_obj({"load": gpt2_ckpt}, dict(cli, batch_size="5")).batch_size == 5
    lm = MegatronLiteLM.create_from_arg_obj({"load": gpt2_ckpt}, dict(cli))
    assert (lm.batch_size, lm.max_gen_toks) == (1, 256)  # lm-eval's default --batch_size; docs/inference.md's 256
    for auto in ("auto", "auto:4"):  # docs/inference.md: auto is 16, in --model_args or lm-eval's --batch_size
        assert MegatronLiteLM.create_from_arg_string(f"load={gpt2_ckpt},batch_size={auto}", dict(cli)).batch_size == 16
        assert MegatronLiteLM.create_from_arg_obj({"load": gpt2_ckpt}, dict(cli, batch_size=auto)).batch_size == 16


@pytest.mark.parametrize("model_args, message", [
    (",batch_size=abc", "--model_args batch_size=abc: use a whole number >= 1 (or auto)"),
    (",dtype=fp16", "--model_args dtype=fp16: use one of float32, bfloat16, float16"),
    (",seed=x", "--model_args seed=x: use a whole number >= 0"),
    (",max_gen_toks=-3", "--model_args max_gen_toks=-3: use a whole number >= 1"),
    (",max_length=2.5", "--model_args max_length=2.5: use a whole number >= 1"),
    (",max_length=97", "--model_args max_length 97: the model has learned positions for 96 tokens only"),  # was cut to 96
    (",bogus=1", "--model_args bogus: not an argument of the megatron_lite backend, which takes load, batch_size"),
    ("/missing", "checkpoint folder "),
])
def test_bad_model_args_are_refused_in_one_line(gpt2_ckpt, model_args, message):
    """A bad --model_args value (or a missing checkpoint) was a bare ValueError (a traceback through
    tools/run_lm_eval.py, exit 1); an unknown argument (a typo: batch_szie=8) was dropped silently."""
    from megatron_lite.checkpoint.format import CheckpointError
    from megatron_lite.errors import ConfigError
    from megatron_lite.inference.lm_eval_backend import MegatronLiteLM

    with pytest.raises((ConfigError, CheckpointError), match="^" + re.escape(message)):
        MegatronLiteLM.create_from_arg_string(f"load={gpt2_ckpt}{model_args}", {"batch_size": 1, "device": "cuda:0"})


@pytest.mark.parametrize("model_args, message", [("load=/missing", "checkpoint folder /missing does not exist"),
                                                 ("load=x,dtype=fp16", "--model_args dtype=fp16: use one of")])
def test_run_lm_eval_ends_a_bad_model_arg_in_one_line_exit_2(model_args, message, monkeypatch, capsys):
    """Through tools/run_lm_eval.py (lm-eval's evaluation replaced by building the model, as it starts)."""
    import lm_eval.__main__

    from megatron_lite.inference.lm_eval_backend import MegatronLiteLM
    from tests.tools import load_tool

    monkeypatch.setattr(lm_eval.__main__.HarnessCLI, "execute", lambda self, args: MegatronLiteLM.create_from_arg_string(
        model_args, {"batch_size": 1, "device": "cuda:0"}))
    monkeypatch.setattr(lm_eval.__main__, "setup_logging", lambda: None)  # its handler would outlive capsys
    with pytest.raises(SystemExit) as exit_:
        load_tool("run_lm_eval").main(["--model", "megatron_lite", "--model_args", model_args, "--tasks", "t"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: " + message) and len(err.splitlines()) == 1


def test_generation_kwargs_are_honoured_or_refused_never_dropped(lm):
    """A refusal is a ConfigError (tools/run_lm_eval.py: one line, exit 2), a wrong kind of value too
    (it was a ValueError traceback)."""
    from megatron_lite.errors import ConfigError

    def params(**kw):
        return lm._params({"until": ["\n"], "max_gen_toks": 8, **kw})[0]

    sampled = params(do_sample=True, temperature=0.7, top_k=5)
    assert (sampled.top_k, sampled.top_p, sampled.temperature) == (5, 0.0, 0.7)
    assert params(do_sample=True, temperature=0.7, top_p=0.9).top_p == 0.9
    assert params(do_sample=False, temperature=0.0, top_k=5).top_k == 1  # greedy, as hf
    assert params(do_sample=True, temperature=0.7, top_p=0.0).top_k == 1  # no nucleus left: greedy (was unfiltered)
    assert params(num_beams=1, repetition_penalty=1.0).top_k == 1  # neutral values change nothing
    for kw, message in [({"repetition_penalty": 1.3}, "repetition_penalty=1.3"), ({"num_beams": 4}, "num_beams=4"),
                        ({"min_new_tokens": 3}, "min_new_tokens=3"),
                        ({"do_sample": True, "temperature": 0.5, "top_k": 5, "top_p": 0.9}, "top_k=5 and top_p=0.9"),
                        ({"max_gen_toks": "many"}, "max_gen_toks='many'.*invalid literal"),
                        ({"do_sample": True, "temperature": 500}, "temperature must be in")]:
        with pytest.raises(ConfigError, match="^generation_kwargs .*" + message):
            params(**kw)


@pytest.fixture(scope="module")
def bos_model(tmp_path_factory):
    """(our checkpoint, its Hugging Face export) of a model whose tokenizer.json puts a BOS before every
    text (a Llama-style post-processor) and decodes words with spaces between them (no decoder)."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    from tests.convert_helpers import convert
    from tests.inference_helpers import VOCAB

    root = tmp_path_factory.mktemp("lm_eval_bos")
    words = ["<unk>", "<s>", "</s>", "one", "two", "three", "four", "system", "user", "assistant"]
    words += [f"w{i}" for i in range(VOCAB - len(words))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    (root / "tok").mkdir()
    tok.save(str(root / "tok" / "tokenizer.json"))
    (root / "tok" / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                                    "chat_template": CHAT}))
    ckpt, hf = str(root / "ckpt"), str(root / "hf")
    save_model("rope_gqa", ckpt, tokenizer={"tokenizer_type": "HuggingFaceTokenizer",
                                            "tokenizer_model": str(root / "tok" / "tokenizer.json")})
    assert convert("GPT", "--saver", "hf", "--load-dir", ckpt, "--save-dir", hf) == 0
    return ckpt, hf


@pytest.fixture(scope="module")
def both(bos_model):
    """(our backend on the checkpoint, lm-eval's hf backend on its export)."""
    pytest.importorskip("accelerate")  # lm-eval's hf backend (lm-eval[hf])
    from lm_eval.models.huggingface import HFLM

    from megatron_lite.inference.lm_eval_backend import MegatronLiteLM

    ckpt, hf_dir = bos_model
    return MegatronLiteLM(load=ckpt, batch_size=2), HFLM(pretrained=hf_dir, dtype="float32", batch_size=2,
                                                          device="cpu")


def test_a_bos_adding_tokenizer_gives_the_hf_backend_numbers_and_texts(bos_model):
    """With a tokenizer that adds a BOS, the empty context is [BOS] + the continuation's own tokens
    and the first rolling window starts from the BOS, as lm-eval's hf backend on the export does; we
    scored the BOS as part of the continuation after an EOD and started
    rolling windows from the EOD (the empty context's sum was 4.1 nats off). A generated text is its
    tokens decoded alone, as hf decodes them: decoded after the prompt, word-level tokens began with a
    space (' w49 ...' where hf has 'w49 ...')."""
    pytest.importorskip("accelerate")  # lm-eval's hf backend (lm-eval[hf])
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from megatron_lite.inference.lm_eval_backend import MegatronLiteLM

    ckpt, hf_dir = bos_model
    ours, theirs = MegatronLiteLM(load=ckpt, batch_size=2), HFLM(pretrained=hf_dir, dtype="float32", batch_size=2,
                                                                  device="cpu")
    assert ours.tok_encode("one two") == theirs.tok_encode("one two") == [1, 3, 4]
    pairs = [Instance("loglikelihood", {}, args, 0) for args in [("", "one two"), ("one", " two three")]]
    got, want = ours.loglikelihood(pairs, disable_tqdm=True), theirs.loglikelihood(pairs, disable_tqdm=True)
    assert [g[1] for g in got] == [w[1] for w in want]
    assert [g[0] for g in got] == pytest.approx([w[0] for w in want], rel=1e-5, abs=1e-5)
    rolling = [Instance("loglikelihood_rolling", {}, ("one two three four one",), 0)]
    assert ours.loglikelihood_rolling(rolling, disable_tqdm=True) == pytest.approx(
        theirs.loglikelihood_rolling(rolling, disable_tqdm=True), rel=1e-5, abs=1e-5)
    gen = [Instance("generate_until", {}, ("one two", {"until": ["three"], "max_gen_toks": 6, "do_sample": False}), 0)]
    text = ours.generate_until(gen, disable_tqdm=True)
    assert text == theirs.generate_until(gen, disable_tqdm=True) and not text[0].startswith(" ")


CONVERSATIONS = [  # (lm-eval's chat history, add_generation_prompt): few-shot turns, a system instruction, gen_prefix
    ([{"role": "system", "content": "one"}, {"role": "user", "content": "two three"},
      {"role": "assistant", "content": "four"}, {"role": "user", "content": "one two"}], True),
    ([{"role": "user", "content": "three four"}], True),
    ([{"role": "user", "content": "one"}, {"role": "assistant", "content": "two "}], False),  # left open
]


def test_chat_template_prompts_give_the_hf_backend_texts_numbers_and_generations(both):
    """--apply_chat_template: the prompts are hf's texts; a prompt that begins with the template's
    "<s>" gets one BOS, not the text's and the post-processor's (we had [1, 1, ...]: every number off);
    its log-likelihoods and greedy generations are hf's."""
    from lm_eval.api.instance import Instance

    ours, theirs = both
    texts = [ours.apply_chat_template(h, add_generation_prompt=g) for h, g in CONVERSATIONS]
    assert texts == [theirs.apply_chat_template(h, add_generation_prompt=g) for h, g in CONVERSATIONS]
    assert texts[2] == "<s>user one </s> assistant two "  # left open: no end of turn after it, as hf
    for text in texts:
        ids = ours.tok_encode(text)
        assert ids == theirs.tok_encode(text) and ids[0] == 1 and ids[1] != 1
    pairs = [Instance("loglikelihood", {}, (text, cont), 0) for text in texts for cont in (" one", " two three")]
    got, want = ours.loglikelihood(pairs, disable_tqdm=True), theirs.loglikelihood(pairs, disable_tqdm=True)
    assert [g[1] for g in got] == [w[1] for w in want]
    assert [g[0] for g in got] == pytest.approx([w[0] for w in want], rel=1e-5, abs=1e-5)
    gen = [Instance("generate_until", {}, (text, {"until": ["four"], "max_gen_toks": 6, "do_sample": False}), 0)
           for text in texts]
    assert ours.generate_until(gen, disable_tqdm=True) == theirs.generate_until(gen, disable_tqdm=True)


def test_a_template_refusing_the_system_message_renders_without_it_as_hf(both, monkeypatch):
    ours, theirs = both
    strict = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}" + CHAT
    monkeypatch.setattr(ours.tokenizer_, "_chat_template", (strict, ours.tokenizer_._chat_template[1]))
    monkeypatch.setattr(theirs.tokenizer, "chat_template", strict)
    history = CONVERSATIONS[0][0]
    assert ours.apply_chat_template(history) == theirs.apply_chat_template(history) == (
        "<s>user two three </s> assistant four </s> user one two </s> assistant ")


def test_the_tokenizer_name_names_the_template_the_same_in_every_run(both, monkeypatch):
    """lm-eval keys its cache of rendered requests on it: a digest of the template and the special
    tokens, fixed text (not a per-process hash), another name for another template."""
    ours, _ = both
    name = ours.tokenizer_name
    assert name == "megatron_lite__ad0243c6f99c400f" and "/" not in name
    monkeypatch.setattr(ours.tokenizer_, "_chat_template", (CHAT + " ", ours.tokenizer_._chat_template[1]))
    assert ours.tokenizer_name != name


def test_lm_eval_with_chat_template_few_shot_turns_and_system_instruction_equals_hf(both, monkeypatch):
    """lm-eval's own path (simple_evaluate with apply_chat_template, fewshot_as_multiturn and a
    system_instruction): the same prompts, log-likelihoods and generated texts as the hf backend."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(FIXTURES)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    runs = [simple_evaluate(model=lm, tasks=["tiny_mc", "tiny_gen"], num_fewshot=1, apply_chat_template=True,
                            fewshot_as_multiturn=True, system_instruction="one two", log_samples=True,
                            task_manager=TaskManager(include_path=FIXTURES, include_defaults=False), limit=2,
                            random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
            for lm in both]
    for task in ("tiny_mc", "tiny_gen"):
        got, want = (sorted(run["samples"][task], key=lambda r: r["doc_id"]) for run in runs)
        assert [r["arguments"] for r in got] == [r["arguments"] for r in want]
        assert got[0]["arguments"][0][0].startswith("<s>system one two")
        if task == "tiny_gen":
            assert [r["resps"] for r in got] == [r["resps"] for r in want]
        else:
            scores = [[x[0] for r in rows for x in r["resps"]] for rows in (got, want)]  # [[(logprob, greedy)], ...]
            assert [g for _, g in scores[0]] == [g for _, g in scores[1]]
            assert [v for v, _ in scores[0]] == pytest.approx([v for v, _ in scores[1]], rel=1e-5, abs=1e-5)


def test_a_tokenizer_without_a_chat_template_is_refused_in_one_line(lm, gpt2_ckpt, monkeypatch, capsys):
    """As the hf backend on the export (no template there either) refuses; we ended in lm-eval's
    NotImplementedError traceback. Through tools/run_lm_eval.py: exit code 2 and one line."""
    from megatron_lite.errors import ConfigError
    from tests.tools import load_tool

    message = "^--apply_chat_template: the checkpoint's tokenizer has no chat template"
    with pytest.raises(ConfigError, match=message):
        lm.apply_chat_template([{"role": "user", "content": "Hello"}])
    with pytest.raises(ConfigError, match=message):
        lm.tokenizer_name  # noqa: B018 - lm-eval reads it first
    monkeypatch.chdir(FIXTURES)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    # the task comes from --include_path: lm-eval's index of its thousands of built-in tasks (~7 s) is left out
    import lm_eval.tasks

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", functools.partial(lm_eval.tasks.TaskManager, include_defaults=False))
    with pytest.raises(SystemExit) as exit_:
        load_tool("run_lm_eval").main(["--model", "megatron_lite", "--model_args", f"load={gpt2_ckpt}",
                                       "--include_path", FIXTURES, "--tasks", "tiny_gen", "--apply_chat_template"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --apply_chat_template: the checkpoint's tokenizer has no chat template")
    assert "Traceback" not in "\n".join(err)
