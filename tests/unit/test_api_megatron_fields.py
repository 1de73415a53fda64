"""PUT /api's request checks (parse_api) that need no model: each bad body is one RequestError
(HTTP 400) naming the field, never another exception (HTTP 500); and its answer's segments."""

import pytest

from megatron_lite.data.tokenizers import NullTokenizer
from megatron_lite.inference.api_megatron import parse_api
from megatron_lite.inference.fields import RequestError


@pytest.mark.parametrize("value", [None, "2", 2.0, True])
def test_a_beam_width_that_is_not_an_integer_is_a_bad_request(value):
    with pytest.raises(RequestError, match=r"^beam_width must be an integer, got "):
        parse_api({"prompts": ["1 2"], "beam_width": value}, NullTokenizer(99))


def test_a_beam_width_runs_beam_search():
    job = parse_api({"prompts": ["1 2"], "beam_width": 3, "tokens_to_generate": 4}, NullTokenizer(99))
    assert job.beam and job.params.beam_width == 3


def test_the_documented_defaults_of_a_bare_request():
    """docs/inference.md's PUT /api table: tokens_to_generate 64, temperature 1.0, top_k 0, top_p 0.0,
    logprobs false, add_BOS false, random_seed -1 (unseeded), no beam search, length_penalty 1.0,
    stop at the end-of-document token."""
    tok = NullTokenizer(99)
    job = parse_api({"prompts": ["1 2"]}, tok)
    p = job.params
    assert (p.tokens_to_generate, p.temperature, p.top_k, p.top_p) == (64, 1.0, 0, 0.0)
    assert (job.logprobs, job.prompts, p.random_seed, job.beam, p.beam_width) == (False, [[1, 2]], None, False, 0)
    assert (p.length_penalty, p.top_p_decay, p.top_p_bound, p.stop_on_eod, p.stop_token_ids) == (1.0, 0.0, 0.0, True, ())
    assert parse_api({"prompts": ["1 2"], "add_BOS": True}, tok).prompts == [[tok.eod, 1, 2]]  # no BOS: the EOD


@pytest.mark.parametrize("body, message", [
    ({"prompts": ["1"] * 129}, "at most 128 prompts per request, got 129"),
    ({"prompts": ["1"] * 128, "tokens_to_generate": 1}, None),
    ({"prompts": ["1"], "temperature": 100.5}, "temperature must be at most 100"),
    ({"prompts": ["1"], "temperature": 100}, None),
    ({"prompts": ["1"], "top_p": 1.5}, "top_p must be at most 1"),
    ({"prompts": ["1"], "beam_width": 129}, "beam_width must be at most 128"),  # a vocabulary of 1001 ids
    ({"prompts": ["1"], "beam_width": 128}, None),
])
def test_the_documented_limits_of_a_request(body, message):
    """docs/inference.md's PUT /api table: 1 to 128 prompts, temperature in (0, 100], top_p in [0, 1],
    beam_width 1 to 128 (at most the vocabulary less one: tests/e2e/test_text_generation_server.py)."""
    tok = NullTokenizer(1000)
    if message is None:
        parse_api(body, tok)
        return
    with pytest.raises(RequestError) as err:
        parse_api(body, tok)
    assert str(err.value).startswith(message), err.value


@pytest.mark.parametrize("name, extra", [("top_p_bound", {"top_p": 0.5}), ("top_p_decay", {"top_p": 0.5}),
                                         ("temperature", {}), ("top_p", {}), ("length_penalty", {"beam_width": 2})])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_nan_and_infinity_are_a_bad_request_naming_the_field(name, extra, value):
    """Python's json reads JSON's NaN / Infinity (what a Python client's ``json=`` sends for a float
    nan): a NaN top_p_bound passed every range check and was served (HTTP 200)."""
    with pytest.raises(RequestError, match=rf"^{name} must be a finite number, got -?(nan|inf)$"):
        parse_api({"prompts": ["1"], **extra, name: value}, NullTokenizer(99))


def test_a_prompt_the_tokenizer_cannot_read_names_it():
    """NullTokenizer's ValueError reached the client without naming the prompt."""
    with pytest.raises(RequestError) as err:
        parse_api({"prompts": ["1 2", "hello"]}, NullTokenizer(99))
    assert str(err.value) == "prompts[1]: NullTokenizer expects space-separated integers, got 'hello'"


def test_segments_are_the_text_each_token_adds_and_join_to_the_generated_text():
    """PUT /api's segments decoded each token alone: GPT-2's byte-level BPE splits an emoji's four bytes
    over two tokens, each of which decoded to U+FFFD. Each segment is now the text its token adds to
    the tokens before it (the first token of the split character adds "", the second the whole
    character), so the generated tokens' segments join to the answer's generated text; also when the
    sequence ends in the middle of a character (its segments join to what its text holds)."""
    from megatron_lite.data.tokenizers import build_tokenizer
    from megatron_lite.inference.api_megatron import ApiJob, api_response
    from megatron_lite.inference.engine import Generation
    from megatron_lite.inference.sampling import SamplingParams
    from tests.inference_helpers import GPT2_TOKENIZER

    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=GPT2_TOKENIZER["vocab_file"],
                          merge_file=GPT2_TOKENIZER["merge_file"])
    prompt, generated = tok.tokenize("Smile:"), tok.tokenize(" 😀 naïve 😀")
    assert generated[:2] == [30325, 222] and tok.detokenize([30325]) == " \ufffd"  # the emoji split over two tokens
    for beam, tokens, text in ((False, prompt + generated, " 😀 naïve 😀"), (True, prompt + generated, " 😀 naïve 😀"),
                               (False, prompt + generated[:-1], " 😀 naïve \ufffd")):
        job = ApiJob(["Smile:"], [prompt], SamplingParams(), False, beam=beam)
        body = api_response(job, [Generation(tokens, len(prompt), [0.0] * (len(tokens) - 1))], tok)
        (segments,) = body["segments"]
        assert body["text"] == ["Smile:" + text] and len(segments) == len(tokens)
        assert segments[:len(prompt)] == ["Sm", "ile", ":"] and "".join(segments[len(prompt):]) == text
        assert segments[len(prompt):len(prompt) + 2] == ["", " 😀"] and "\ufffd" not in "".join(segments[:-1])
