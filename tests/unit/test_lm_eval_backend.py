"""The lm-eval backend's edge cases, against what lm-eval's ``hf`` backend returns for them: a
continuation that tokenizes to nothing (BPE merges it into the context's last token) scores
``(0.0, True)``, not the whole context; a batch size below 1 is refused before loading."""

import pytest

from tests.inference_helpers import GPT2_TOKENIZER, save_model

pytest.importorskip("lm_eval")


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    from megatron_lite.inference.lm_eval_backend import MegatronLiteLM

    root = str(tmp_path_factory.mktemp("lm_eval_backend") / "ckpt")
    save_model("gpt", root, tokenizer=GPT2_TOKENIZER)
    return MegatronLiteLM(load=root, batch_size=2)


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


def test_a_batch_size_below_one_is_refused():
    from megatron_lite.inference.lm_eval_backend import MegatronLiteLM

    with pytest.raises(ValueError, match="batch_size=0: use a positive number"):
        MegatronLiteLM(load="/nonexistent", batch_size=0)


def test_generation_kwargs_are_honoured_or_refused_never_dropped(lm):
    def params(**kw):
        return lm._params({"until": ["\n"], "max_gen_toks": 8, **kw})[0]

    sampled = params(do_sample=True, temperature=0.7, top_k=5)
    assert (sampled.top_k, sampled.top_p, sampled.temperature) == (5, 0.0, 0.7)
    assert params(do_sample=True, temperature=0.7, top_p=0.9).top_p == 0.9
    assert params(do_sample=False, temperature=0.0, top_k=5).top_k == 1  # greedy, as hf
    assert params(num_beams=1, repetition_penalty=1.0).top_k == 1  # neutral values change nothing
    for kw, message in [({"repetition_penalty": 1.3}, "repetition_penalty=1.3"), ({"num_beams": 4}, "num_beams=4"),
                        ({"min_new_tokens": 3}, "min_new_tokens=3"),
                        ({"do_sample": True, "temperature": 0.5, "top_k": 5, "top_p": 0.9}, "top_k=5 and top_p=0.9")]:
        with pytest.raises(ValueError, match="^generation_kwargs .*" + message):
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
    words = ["<unk>", "<s>", "</s>", "one", "two", "three", "four"]
    words += [f"w{i}" for i in range(VOCAB - len(words))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    (root / "tok").mkdir()
    tok.save(str(root / "tok" / "tokenizer.json"))
    (root / "tok" / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    ckpt, hf = str(root / "ckpt"), str(root / "hf")
    save_model("rope_gqa", ckpt, tokenizer={"tokenizer_type": "HuggingFaceTokenizer",
                                            "tokenizer_model": str(root / "tok" / "tokenizer.json")})
    assert convert("GPT", "--saver", "hf", "--load-dir", ckpt, "--save-dir", hf) == 0
    return ckpt, hf


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
