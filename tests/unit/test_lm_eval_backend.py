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
