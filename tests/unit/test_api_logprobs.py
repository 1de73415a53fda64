"""OpenAI's logprobs objects when two token ids decode to the same text (a byte-level BPE has several
spellings of one string; a partial UTF-8 character decodes to U+FFFD for many ids): chat's
``top_logprobs`` is a list, as OpenAI's ``[{token, logprob, bytes}]``, and keeps every entry;
completions' is OpenAI's dict keyed by text, which keeps the most likely of those ids, not the last."""

from megatron_lite.inference.api_logprobs import logprobs_object
from megatron_lite.inference.engine import Generation


class Texts:
    """Token ids to text: 1 and 2 are both "a", 3 is "b", 4 half a character (U+FFFD)."""

    TEXT = {0: "<s>", 1: "a", 2: "a", 3: "b", 4: "\ufffd"}

    def detokenize(self, ids):
        return "".join(self.TEXT[i] for i in ids)


# the prompt [0], then 1 and 3: at each position the best three, best first, two of them "a"
TOPS = [[(1, -0.5), (2, -1.0), (3, -2.0)], [(3, -0.1), (4, -2.5), (2, -3.0)]]
RESULT = Generation([0, 1, 3], 1, [-0.5, -0.1], top_log_probs=TOPS)


def test_chat_keeps_every_top_entry_with_its_bytes():
    content = logprobs_object(RESULT, Texts(), 1, 3, chat=True)["content"]
    assert [e["token"] for e in content] == ["a", "b"] and [e["logprob"] for e in content] == [-0.5, -0.1]
    assert content[0]["bytes"] == [97]
    assert content[0]["top_logprobs"] == [{"token": "a", "logprob": -0.5, "bytes": [97]},
                                          {"token": "a", "logprob": -1.0, "bytes": [97]},
                                          {"token": "b", "logprob": -2.0, "bytes": [98]}]
    assert [e["logprob"] for e in content[1]["top_logprobs"]] == [-0.1, -2.5, -3.0]
    assert content[1]["top_logprobs"][1]["bytes"] is None  # not the bytes of U+FFFD, which it is not


def test_completions_keep_the_most_likely_of_one_text():
    out = logprobs_object(RESULT, Texts(), 1, 3, chat=False)
    assert out["tokens"] == ["a", "b"] and out["token_logprobs"] == [-0.5, -0.1]
    assert out["top_logprobs"] == [{"a": -0.5, "b": -2.0}, {"b": -0.1, "\ufffd": -2.5, "a": -3.0}]
