"""Prefix caching in the paged key/value cache (inference/paged_cache.py) and rows given back as
soon as a sequence ends (inference/scheduler.py), in one process.

Requests whose prompts share full blocks with earlier ones start after those blocks (the prefill
tokens saved are counted) and answer as each request alone (tokens, log-probs within 1e-5 past the
reused prefix, which holds NaN); the n choices of one request hold one copy of their prompt blocks;
cached blocks nobody holds are evicted only when the pool needs them; sharing lets requests decode
together in a pool too small for them apart, and nobody runs out of blocks; a choice of an n > 1
request that stops frees its row, which a waiting request takes before the other choice ends.
"""

import pytest
import torch

from megatron_lite.inference.engine import InferenceEngine
from megatron_lite.inference.paged_cache import PagedCache, chain_hashes
from megatron_lite.inference.sampling import SamplingParams
from megatron_lite.inference.scheduler import Scheduler
from tests.batching_helpers import (
    PAGED,
    PREFIX_CACHED,
    PREFIX_JOINS,
    PREFIX_REUSED,
    SHARED,
    all_blocks_back,
    assert_same,
    prefix_requests,
    run,
    saved_engines,
)
from tests.inference_helpers import prompts
from tests.unit.test_sliding_window import windowed_model


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    return saved_engines(str(tmp_path_factory.mktemp("prefix")), ("gpt", "mla_mtp"))



def test_chain_hashes_name_a_block_by_every_token_up_to_its_end():
    a, b = chain_hashes([1, 2, 3, 4, 5], 2), chain_hashes([1, 2, 3, 4], 2)
    assert len(a) == 2 and a == b  # full blocks only
    assert chain_hashes([9, 2, 3, 4], 2)[1] != a[1]  # same block tokens, another prefix
    assert chain_hashes([12, 3], 2) != chain_hashes([1, 23], 2)


@pytest.mark.parametrize("variant", ["gpt", "mla_mtp"])
def test_shared_prefixes_are_computed_once_and_answer_as_each_request_alone(engines, variant):
    engine, requests = engines[variant], prefix_requests()
    scheduler = Scheduler(engine, 6, **PAGED, prefix_caching=True)
    results, _, events = run(scheduler, requests, PREFIX_JOINS)
    assert scheduler.cache.reused_tokens == PREFIX_REUSED
    for i, (cached, (p, params)) in enumerate(zip(PREFIX_CACHED, requests)):
        assert_same(engine.generate(p, params), results[i], cached)
    steps = [e.step for e in events if e.rid == 2]  # the stream still starts at position 0 (NaN where reused)
    assert steps[0].start == 0 and len(steps[0].log_probs[0]) == len(SHARED)
    fourth = {tuple(r.tokens[12:16]) for i in (0, 2) for r in results[i]}  # SHARED[12] and 3 written answer tokens
    assert all_blocks_back(scheduler.cache) and len(scheduler.cache.cached) == 3 + 1 + len(fourth)  # + the 2nd's 3rd
    without = Scheduler(engine, 6, **PAGED)
    results_off, _, _ = run(without, requests, PREFIX_JOINS)
    assert without.cache.reused_tokens == 0 and not without.cache.cached
    assert [r.tokens for i in results for r in results[i]] == [r.tokens for i in results for r in results_off[i]]


def test_the_choices_of_a_request_hold_one_copy_of_their_prompt_blocks(engines):
    """3 choices of a 12-token prompt (3 blocks of 4) growing to 15 tokens: 4 blocks each apart, 3
    shared + 1 each together: the pool of 6 holds them only shared. With prompt log-probs asked
    for, nothing is skipped: every choice computes its prompt, the first writes the shared blocks."""
    engine = engines["gpt"]
    request = ([SHARED[:12]] * 3, SamplingParams(tokens_to_generate=4, temperature=0.9, top_k=5, random_seed=4))
    scheduler = Scheduler(engine, 3, block_size=4, num_blocks=6, prefix_caching=True)
    results, ended, _ = run(scheduler, [request], [0])
    assert_same(engine.generate(*request), results[0]) and scheduler.cache.reused_tokens == 0
    assert len({tuple(r.generated) for r in results[0]}) > 1  # the choices did differ
    with pytest.raises(ValueError, match="needs 12 key/value-cache blocks"):
        Scheduler(engine, 3, block_size=4, num_blocks=6).add(*request)  # without sharing: refused


def test_cached_blocks_are_evicted_only_when_the_pool_needs_them(engines):
    engine = engines["gpt"]
    p, q, r = prompts(3, seed=7, lengths=(13, 13, 13))
    params = SamplingParams(tokens_to_generate=3, top_k=1, prompt_log_probs=False)  # 15 tokens: 4 blocks
    scheduler = Scheduler(engine, 2, block_size=4, num_blocks=8, prefix_caching=True)
    reused = []
    for prompt in (p, q, p, r, p, q):  # one at a time: a block nobody holds stays cached until taken
        before = scheduler.cache.reused_tokens
        rid = scheduler.add([prompt], params)
        results = [e.results for _ in range(20) for e in scheduler.run_step() if e.rid == rid and e.results]
        reused.append(scheduler.cache.reused_tokens - before)
        assert_same(engine.generate([prompt], params), results[0], reused[-1]) and not scheduler.busy
        assert all_blocks_back(scheduler.cache)
    # 8 blocks: q takes the 4 never used, p's 3 prompt blocks stay cached; r needs 4 of the pool: the unnamed
    # one and the two least recently freed named ones (q's last two, not p's, freed later): q finds its first
    assert reused == [0, 0, 12, 0, 12, 4] and scheduler.cache.evicted_blocks >= 2


def test_requests_sharing_blocks_decode_together_in_a_pool_too_small_for_them_apart(engines):
    engine = engines["gpt"]
    first = ([SHARED], SamplingParams(tokens_to_generate=3, top_k=1, prompt_log_probs=False))  # 4 blocks
    second = ([SHARED[:12] + [7]], SamplingParams(tokens_to_generate=3, top_k=1, prompt_log_probs=False))  # 1 more
    for caching, joined_while_first_ran in ((True, True), (False, False)):
        scheduler = Scheduler(engine, 2, block_size=4, num_blocks=5, prefix_caching=caching)
        results, ended, events = run(scheduler, [first, second], [0, 1])
        start = min(i for i, e in enumerate(events) if e.rid == 1)
        assert (start < max(i for i, e in enumerate(events) if e.rid == 0)) == joined_while_first_ran
        assert_same(engine.generate(*first), results[0]) and all_blocks_back(scheduler.cache)
        assert_same(engine.generate(*second), results[1], 12 if caching else 0)


def test_a_stopped_choice_gives_its_row_to_a_waiting_request(engines):
    engine = engines["gpt"]
    params = SamplingParams(tokens_to_generate=12, temperature=1.0, top_k=8, random_seed=4, stop_on_eod=False)
    two = engine.generate([SHARED[:5]] * 2, params)
    stop = next(t for t in two[0].generated[:4] if t not in two[1].generated)  # ends choice 0 only
    request = ([SHARED[:5]] * 2, SamplingParams(**{**params.__dict__, "stop_token_ids": (stop,)}))
    waiting = ([[8, 8, 2]], SamplingParams(tokens_to_generate=3, top_k=1))
    scheduler = Scheduler(engine, 2, block_size=4, num_blocks=20)
    results, ended, events = run(scheduler, [request, waiting], [0, 0])
    assert results[0][0].finish_reason == "stop" and results[0][1].finish_reason == "length"
    assert_same(engine.generate(*request), results[0]) and assert_same(engine.generate(*waiting), results[1])
    assert ended[1] < ended[0]  # it took choice 0's row and ended first
    assert all_blocks_back(scheduler.cache) and scheduler.cache.free == [0, 1]


def test_a_row_shares_blocks_only_with_rows_of_its_request_that_write_them():
    cache = PagedCache(3, 16, block_size=2, num_blocks=9, prefix_caching=True)
    rows = cache.allocate(2, 6, [[1, 2, 3, 4, 5], [1, 2, 3, 9, 5]])
    assert rows == [0, 1] and cache.shared[1] == {0: 0} and cache.available == 9 - 3 - 2
    cache.begin(rows, 5, "cpu")
    assert cache.tables[0][0] == cache.tables[1][0] and cache.tables[0][1] != cache.tables[1][1]
    assert cache.refs[cache.tables[0][0]] == 2


def chat(scheduler, messages, params):
    """A chat, one turn at a time: each turn's prompt is the last turn's whole sequence (prompt and
    answer) and its message; return each turn's result and the prompt tokens it took from the cache."""
    history, results, reused = [], [], []
    for message in messages:
        before = scheduler.cache.reused_tokens
        rid = scheduler.add([history + message], params)
        results.append(next(e.results for _ in range(99) for e in scheduler.run_step() if e.rid == rid and e.results))
        reused.append(scheduler.cache.reused_tokens - before)
        assert not scheduler.busy and all_blocks_back(scheduler.cache)
        history = results[-1][0].tokens
    return results, reused


GREEDY = SamplingParams(tokens_to_generate=9, top_k=1, top_n_logprobs=2, stop_on_eod=False, prompt_log_probs=False)


@pytest.mark.parametrize("variant", ["gpt", "mla_mtp"])
def test_a_chat_turn_reuses_the_blocks_of_the_last_answer(engines, variant):
    """Turns of 6, 3 and 2 new tokens, answers of 9, blocks of 4: turn 1 writes 14 tokens (its last
    is sampled, never fed), so 3 blocks are named, 2 of them holding answer tokens; turn 2 (18
    tokens) starts at 12, writes 26 and names 6 blocks; turn 3 (29 tokens) starts at 24. Tokens
    equal and log-probs within 1e-5 of the same chat without prefix caching (NaN where reused)."""
    messages = prompts(3, seed=3, lengths=(6, 3, 2))
    scheduler = Scheduler(engines[variant], 2, block_size=4, num_blocks=24, prefix_caching=True)
    results, reused = chat(scheduler, messages, GREEDY)
    assert reused == [0, 12, 24] and [len(r[0].tokens) for r in results] == [15, 27, 38]
    off = Scheduler(engines[variant], 2, block_size=4, num_blocks=24)
    results_off, reused_off = chat(off, messages, GREEDY)
    assert reused_off == [0, 0, 0] and not off.cache.cached
    for alone, batched, cached in zip(results_off, results, reused):
        assert_same(alone, batched, cached)


@pytest.mark.parametrize("generate, reused", [(8, 12), (9, 16)])
def test_a_block_is_named_only_once_every_position_is_written(engines, generate, reused):
    """An 8-token prompt and an answer of 8 ends at a block boundary (16 tokens), but its last token
    is never fed: the 4th block holds 3 written positions and stays unnamed, so the next turn reuses
    3 blocks; an answer of 9 writes the 4th block whole and the next turn reuses it."""
    engine = engines["gpt"]
    params = SamplingParams(**{**GREEDY.__dict__, "tokens_to_generate": generate})
    messages = prompts(2, seed=8, lengths=(8, 2))
    scheduler = Scheduler(engine, 2, block_size=4, num_blocks=12, prefix_caching=True)
    results, got = chat(scheduler, messages, params)
    assert got == [0, reused] and len(scheduler.cache.cached) == (2 * generate + 9) // 4  # turn 2 wrote 2g + 9
    results_off, _ = chat(Scheduler(engine, 2, block_size=4, num_blocks=12), messages, params)
    for alone, batched, cached in zip(results_off, results, got):
        assert_same(alone, batched, cached)


def test_a_windowed_chat_reuses_answer_blocks_past_the_window():
    """Every layer windowed (4 keys back), blocks of 4: turn 1 (7 tokens, answer of 14) names its
    5 written blocks as it passes them and drops all but the last 2; turn 2 (24 tokens) starts at 20,
    holding only the blocks its window reaches, and answers as the model without a cache."""
    model = windowed_model(window=(4, 0), skip=None)
    messages = [torch.randint(0, 99, (n,), generator=torch.Generator().manual_seed(6)).tolist() for n in (7, 3)]
    params = SamplingParams(**{**GREEDY.__dict__, "tokens_to_generate": 14})
    scheduler = Scheduler(InferenceEngine(model, vocab_size=100, max_sequence_length=48), 1, block_size=4,
                          num_blocks=12, prefix_caching=True)
    results, reused = chat(scheduler, messages, params)
    reference = InferenceEngine(model, vocab_size=100, max_sequence_length=48, use_cache=False)
    assert reused == [0, 20] and scheduler.cache.evicted_blocks == 0
    assert_same(reference.generate([messages[0]], params), results[0])
    assert_same(reference.generate([results[0][0].tokens + messages[1]], params), results[1], 20)
