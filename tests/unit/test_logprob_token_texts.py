"""The ``tokens`` of a completion's ``logprobs`` (and chat's ``token``s, and the keys of
``top_logprobs``) are each token's own text in the answer, and ``text_offset`` points at it. Each
token used to be decoded alone: a SentencePiece word start lost its space (" list" came back as
"list"), so the tokens did not join to the text and every offset after the first word was short by
one per word (``"A list IPwn"``: offsets 0, 1, 5, 7 instead of 0, 1, 6, 9). Byte-level BPE (GPT-2),
which keeps its spaces, is unchanged."""

import pytest

from megatron_lite.data.tokenizers import build_tokenizer
from megatron_lite.inference.api_logprobs import ChunkLogprobs, logprobs_object
from megatron_lite.inference.engine import Generation
from tests.inference_helpers import GPT2_TOKENIZER, tiny_sentencepiece

TEXT = "A list is a mutable sequence, and the for statement iterates over it. Der naive Bar am Ende, cafe."


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    return {"gpt2": build_tokenizer(**GPT2_TOKENIZER),
            "sentencepiece": tiny_sentencepiece(str(tmp_path_factory.mktemp("spm")), [TEXT])}


def _result(tokens, prompt_length):
    n = len(tokens)
    tops = [[(t, -1.0), (tokens[0], -2.0)] for t in tokens[1:]]
    return Generation(list(tokens), prompt_length, [-0.5] * (n - 1), top_log_probs=tops)


@pytest.mark.parametrize("name", ["gpt2", "sentencepiece"])
@pytest.mark.parametrize("echo", [True, False])
def test_the_tokens_join_to_the_text_and_the_offsets_point_at_them(tokenizers, name, echo):
    tok = tokenizers[name]
    ids = tok.tokenize(TEXT)
    prompt = 5
    result = _result(ids, prompt)
    first = 0 if echo else prompt
    text = tok.detokenize(ids) if echo else tok.detokenize(ids)[len(tok.detokenize(ids[:prompt])):]
    lp = logprobs_object(result, tok, first, len(ids), chat=False)
    assert "".join(lp["tokens"]) == text
    for string, offset in zip(lp["tokens"], lp["text_offset"]):
        assert text[offset:offset + len(string)] == string
    if name == "sentencepiece":
        assert any(s.startswith(" ") for s in lp["tokens"])  # word starts keep their space
        assert all(k == lp["tokens"][j] for j, top in enumerate(lp["top_logprobs"]) if top for k in list(top)[:1])
    chat = logprobs_object(result, tok, first, len(ids), chat=True)
    assert [e["token"] for e in chat["content"]] == lp["tokens"]


@pytest.mark.parametrize("name", ["gpt2", "sentencepiece"])
def test_streamed_chunks_give_the_same_entries(tokenizers, name):
    tok = tokenizers[name]
    ids = tok.tokenize(TEXT)
    result = _result(ids, 5)
    whole = logprobs_object(result, tok, 5, len(ids), chat=False)
    chunks = ChunkLogprobs(tok, ids[:5], chat=False, echo=False)
    chunks.finish(result)
    parts = [chunks.take(e) for e in range(6, len(ids) + 1, 3)] + [chunks.rest()]
    assert sum((p["tokens"] for p in parts), []) == whole["tokens"]
    assert sum((p["text_offset"] for p in parts), []) == whole["text_offset"]
