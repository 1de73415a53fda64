"""Megatron's beam search in the engine (megatron_lite/inference/beam.py), and Megatron's other
``PUT /api`` generation fields in the engine (stop_on_double_eol, prevent_newline_after_colon,
top_p_decay / top_p_bound).

Beam search: width 1 is greedy; over two new tokens with ``vocab - 1`` beams it is exact, so its
hypotheses equal an exhaustive search scored by full forward passes; the key/value cache (whose
rows are reordered by beam origin every step, standard attention and MLA's compressed cache)
gives what recomputing the whole prefix gives. Tolerances: fp32, scores within 1e-5 relative."""

import itertools

import pytest
import torch

from megatron_lite.inference.engine import InferenceEngine
from megatron_lite.inference.kv_cache import KVCache
from megatron_lite.inference.sampling import SamplingParams, decayed_top_p
from megatron_lite.models import GPTModel, TransformerConfig
from megatron_lite.parallel.state import ParallelState
from tests.inference_helpers import (
    MAX_LEN,
    VOCAB,
    assert_close,
    build_model,
    model_config,
    prompts,
    randomize,
)

SMALL = 12  # a vocabulary small enough for an exhaustive search; id 11 ends a document


def engine_of(model, vocab=VOCAB, **kw):
    return InferenceEngine(model, vocab_size=vocab, max_sequence_length=MAX_LEN, eod=vocab - 1, **kw)


@pytest.fixture(scope="module")
def small_model():
    model = GPTModel(TransformerConfig.from_model(model_config("gpt", vocab=SMALL)), ParallelState(world_size=1, rank=0))
    randomize(model, 3)
    return model.eval()


@pytest.mark.parametrize("variant", ["gpt", "mla_mtp"])
@pytest.mark.parametrize("stop_on_eod", [True, False])
def test_beam_width_1_is_greedy(variant, stop_on_eod):
    engine = engine_of(build_model(variant))
    for prompt in prompts(3):
        greedy = engine.generate([prompt], SamplingParams(tokens_to_generate=20, top_k=1, stop_on_eod=stop_on_eod))[0]
        beam = engine.generate([prompt], SamplingParams(tokens_to_generate=20, beam_width=1, stop_on_eod=stop_on_eod,
                                                        length_penalty=0.5))
        assert len(beam) == 1 and beam[0].tokens == greedy.tokens
        new = greedy.log_probs[len(prompt) - 1:]
        assert beam[0].score == pytest.approx(sum(new) / len(new) ** 0.5, rel=1e-5)


def exhaustive(model, prompt, stop, length_penalty):
    """Every continuation of at most two tokens (a stop token only last), scored by one forward
    pass over the whole sequence: ``(score, tokens)``, best first."""
    seqs = [prompt + [stop]] + [prompt + [x, y] for x, y in itertools.product(range(SMALL), repeat=2) if x != stop]
    out = []
    for seq in seqs:
        with torch.no_grad():
            logp = model(torch.tensor([seq]))[0, :-1, :SMALL].log_softmax(-1)
        new = logp[len(prompt) - 1:].gather(-1, torch.tensor(seq[len(prompt):]).unsqueeze(-1)).sum().item()
        out.append((new / (len(seq) - len(prompt)) ** length_penalty, seq))
    return sorted(out, key=lambda s: s[0], reverse=True)


@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 3.0, -0.5])
@pytest.mark.parametrize("prompt", [[3, 1, 8, 4], [4, 2, 9, 1]])
def test_beam_search_over_two_tokens_equals_an_exhaustive_search(small_model, prompt, length_penalty):
    """With every first token kept (vocab - 1 beams) and two new tokens the search is exact. For the
    first prompt greedy decoding misses the best pair; the second has many hypotheses ending at the
    stop token (of length 1 or 2: the length penalty matters)."""
    engine, width, stop = engine_of(small_model, SMALL), SMALL - 1, SMALL - 1
    beams = engine.generate([prompt], SamplingParams(tokens_to_generate=2, beam_width=width,
                                                     length_penalty=length_penalty))
    want = exhaustive(small_model, prompt, stop, length_penalty)[:width]
    assert [b.tokens for b in beams] == [seq for _, seq in want]
    assert_close(torch.tensor([b.score for b in beams]), torch.tensor([s for s, _ in want]))
    assert [b.finish_reason for b in beams] == ["stop" if seq[-1] == stop else "length" for _, seq in want]
    greedy = engine.generate([prompt], SamplingParams(tokens_to_generate=2, top_k=1))[0]
    if prompt == [3, 1, 8, 4]:
        assert greedy.tokens != beams[0].tokens  # beam search finds a better pair than greedy
    else:
        assert sum(b.tokens[-1] == stop for b in beams) >= 5


@pytest.mark.parametrize("variant", ["rope_gqa", "mla_mtp"])
def test_cached_beam_search_equals_recomputing_the_prefix(variant):
    model = build_model(variant)
    params = SamplingParams(tokens_to_generate=12, beam_width=5, length_penalty=1.3)
    for prompt in prompts(2, lengths=(4, 9)):
        cached = engine_of(model).generate([prompt], params)
        full = engine_of(model, use_cache=False).generate([prompt], params)
        assert [c.tokens for c in cached] == [f.tokens for f in full]
        assert len({tuple(c.tokens) for c in cached}) == 5  # five different hypotheses
        assert_close(torch.tensor([c.score for c in cached]), torch.tensor([f.score for f in full]))


def test_kv_cache_reorder_copies_rows_in_every_tensor():
    cache = KVCache(3, 4)
    k, latent = torch.arange(2 * 3 * 2.0).view(2, 3, 2), torch.arange(2 * 3.0).view(2, 3)
    cache.append(1, k, latent)
    cache.advance(2)
    cache.reorder(torch.tensor([2, 0, 0]))
    k2, latent2 = cache.memory[1]
    assert torch.equal(k2[:2, :3], k[:, [2, 0, 0]]) and torch.equal(latent2[:2, :3], latent[:, [2, 0, 0]])


@pytest.mark.parametrize("bad, message", [
    (dict(beam_width=2, tokens_to_generate=0), None),  # scoring only: allowed, no beam
    (dict(beam_width=SMALL, tokens_to_generate=2), "beam_width must be at most 11"),
])
def test_beam_search_limits(small_model, bad, message):
    engine = engine_of(small_model, SMALL)
    if message is None:
        assert engine.generate([[1, 2]], SamplingParams(**bad))[0].score is None
        return
    with pytest.raises(ValueError, match=message):
        engine.generate([[1, 2]], SamplingParams(**bad))
    with pytest.raises(ValueError, match="one prompt at a time"):
        engine.generate([[1, 2], [3]], SamplingParams(beam_width=2, tokens_to_generate=2))


# -- Megatron's other generation fields ---------------------------------------------------------
FORCED = dict(top_k=1, stop_on_eod=False, tokens_to_generate=8, logit_bias=((5, 100.0),))  # greedy picks 5


def test_stop_on_double_eol_stops_at_a_pair_the_prompt_may_start():
    engine = engine_of(build_model("gpt"))
    params = SamplingParams(double_stop_ids=(5, 6), **FORCED)
    got = engine.generate([[1, 2], [1, 6]], params)
    assert [g.generated for g in got] == [[5, 5], [5]] and {g.finish_reason for g in got} == {"stop"}
    assert engine.generate([[1, 2]], SamplingParams(**FORCED))[0].generated == [5] * 8


def test_prevent_newline_after_colon_bans_the_tokens_after_the_marker():
    engine = engine_of(build_model("gpt"))
    params = SamplingParams(ban_after_ids=(7,), banned_ids=(5,), **FORCED)
    got = engine.generate([[1, 7], [1, 2]], params)
    seq = got[0].tokens
    assert seq[2] != 5 and 5 in seq  # banned right after a 7 only (the forced 5 everywhere else)
    assert all((b != 5) if a == 7 else (b == 5) for a, b in zip(seq[1:], seq[2:]))
    assert got[1].generated == [5] * 8


def test_top_p_decays_to_its_bound_after_every_step():
    params = SamplingParams(top_p=0.9, top_p_decay=0.5, top_p_bound=0.3)
    seen = []
    for _ in range(3):
        params = decayed_top_p(params)
        seen.append(params.top_p)
    assert seen == pytest.approx([0.45, 0.3, 0.3])
    assert decayed_top_p(SamplingParams(top_p=0.9, top_p_decay=0.5)).top_p == pytest.approx(0.45)


def test_a_decayed_top_p_samples_the_first_token_then_is_greedy():
    engine = engine_of(build_model("gpt"))
    prompt = prompts(1)[0]
    params = SamplingParams(tokens_to_generate=10, top_p=0.99, temperature=3.0, top_p_decay=1e-6, random_seed=2,
                            stop_on_eod=False)
    got = engine.generate([prompt], params)[0].generated
    greedy = engine.generate([prompt + got[:1]], SamplingParams(tokens_to_generate=9, top_k=1, stop_on_eod=False))
    assert got[1:] == greedy[0].generated
    undecayed = engine.generate([prompt], SamplingParams(tokens_to_generate=10, top_p=0.99, temperature=3.0,
                                                          random_seed=2, stop_on_eod=False))[0].generated
    assert undecayed[:1] == got[:1] and undecayed != got


@pytest.mark.parametrize("bad, message", [
    (dict(top_p_decay=0.5), "top_p_decay must be in [0, 1] and needs top_p > 0"),
    (dict(top_p=0.5, top_p_bound=0.6), "top_p_bound must be in [0, top_p]"),
    (dict(beam_width=-1), "beam_width must be an integer >= 0"),
    (dict(length_penalty=float("nan")), "length_penalty must be a finite number"),
])
def test_bad_megatron_params_are_refused(bad, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**bad).check()


def test_beam_search_honours_the_newline_ban(small_model):
    """prevent_newline_after_colon in beam search: no hypothesis has a banned token right after a
    marker, though without the ban some do."""
    engine, prompt = engine_of(small_model, SMALL), [3, 1, 8, 4]
    plain = engine.generate([prompt], SamplingParams(tokens_to_generate=4, beam_width=6))
    pairs = {(a, b) for h in plain for a, b in zip(h.tokens[3:], h.tokens[4:])}
    marker, banned = sorted(pairs)[0]
    banning = engine.generate([prompt], SamplingParams(tokens_to_generate=4, beam_width=6, ban_after_ids=(marker,),
                                                       banned_ids=(banned,)))
    assert all((a, b) != (marker, banned) for h in banning for a, b in zip(h.tokens[3:], h.tokens[4:]))


@pytest.mark.parametrize("length_penalty", [1.0, 2.0])
def test_a_stop_token_ends_the_search_when_no_beam_can_beat_the_hypotheses(length_penalty):
    """Width 1 meets the stop token the greedy continuation reaches: the search ends there (the
    best running sum at that length cannot beat the finished hypothesis), as greedy stops."""
    engine = engine_of(build_model("gpt"))
    for prompt in prompts(3):
        free = engine.generate([prompt], SamplingParams(tokens_to_generate=20, top_k=1, stop_on_eod=False))[0]
        stop = free.generated[2]
        greedy = engine.generate([prompt], SamplingParams(tokens_to_generate=20, top_k=1, stop_on_eod=False,
                                                          stop_token_ids=(stop,)))[0]
        beam = engine.generate([prompt], SamplingParams(tokens_to_generate=20, beam_width=1, stop_on_eod=False,
                                                        stop_token_ids=(stop,), length_penalty=length_penalty))
        assert beam[0].tokens == greedy.tokens and beam[0].finish_reason == "stop" == greedy.finish_reason


def test_hypotheses_keep_the_best_and_know_when_the_search_is_done():
    from megatron_lite.inference.beam import Hypotheses

    found = Hypotheses(2, 1.0)
    found.add([1], -4.0, 2, True)  # score -2
    assert not found.is_done(-100.0, 2)  # fewer than 2 hypotheses
    found.add([2], -3.0, 3, True)  # -1
    found.add([3], -9.0, 3, True)  # -3: worse than both, not kept
    assert [h[1] for h in found.best()] == [[2], [1]]
    assert found.is_done(-8.0, 4) and found.is_done(-8.0, 2 * 2)  # best open -2 per token: cannot beat -2
    assert not found.is_done(-7.9, 4)
    found.add([4], -1.0, 2, True)  # -0.5 replaces the worst (-2)
    assert [h[0] for h in found.best()] == [-0.5, -1.0]


def test_beam_search_with_more_stop_tokens_than_megatrons_candidates_allow(small_model):
    """Several stop tokens (the Python API's stop_token_ids): the ``2 x width`` candidates Megatron
    ranks for its one stop token can all be stop tokens, leaving no beam to continue (it crashed:
    'selected index k out of range'). Every step must keep ``width`` beams; for this prompt the answer
    is the best two of all one- and two-token continuations (width = the vocabulary less the stops)."""
    stops = tuple(range(2, SMALL - 1))  # and the end-of-document token SMALL - 1: all but 0 and 1
    engine, prompt = engine_of(small_model, SMALL), [3, 1, 8, 4]
    beams = engine.generate([prompt], SamplingParams(tokens_to_generate=2, beam_width=2, stop_token_ids=stops))
    ends = set(stops) | {SMALL - 1}
    seqs = [prompt + [s] for s in sorted(ends)] + [prompt + [x, y] for x in (0, 1) for y in range(SMALL)]
    scored = []
    for seq in seqs:
        with torch.no_grad():
            logp = small_model(torch.tensor([seq]))[0, :-1, :SMALL].log_softmax(-1)
        new = logp[len(prompt) - 1:].gather(-1, torch.tensor(seq[len(prompt):]).unsqueeze(-1)).sum().item()
        scored.append((new / (len(seq) - len(prompt)), seq))
    want = sorted(scored, key=lambda s: s[0], reverse=True)[:2]
    assert [b.tokens for b in beams] == [seq for _, seq in want]
    assert_close(torch.tensor([b.score for b in beams]), torch.tensor([s for s, _ in want]))
