"""The paged key/value cache of a model whose every layer has a sliding window (inference/paged_cache.py).

A row returns the blocks wholly before its next queries' windows, reads its keys from the earliest
position a row of the pass still holds, and is promised only the blocks it holds at once; a model
with a full-attention layer keeps every block. Continuous batching past the window (rows at
different lengths, chunked prefill, a pool far smaller than whole rows need) equals the engine
without a cache: the same tokens, log-probs within 1e-5.
"""

import torch

from megatron_lite.inference.engine import InferenceEngine
from megatron_lite.inference.paged_cache import PagedCache
from megatron_lite.inference.sampling import SamplingParams
from megatron_lite.inference.scheduler import Scheduler
from megatron_lite.models.window_config import cache_reach
from tests.batching_helpers import assert_same, run
from tests.unit.test_sliding_window import windowed_model


def test_reach_needs_every_layer_windowed():
    assert cache_reach(windowed_model(window=(4, 0), skip=None).config) == 4
    assert cache_reach(windowed_model(window=(4, 0), skip="[1,1,1,1]").config) == 4
    assert cache_reach(windowed_model(window=(4, 0), skip="2").config) is None  # Mistral-style full layers
    assert cache_reach(windowed_model(window=(-1, 0), skip=None).config) is None  # unbounded to the left


def test_blocks_beyond_the_window_go_back_to_the_pool():
    cache = PagedCache(2, 40, block_size=4, num_blocks=8, reach=5)
    assert cache.row_blocks(30, prefill=6) == 3 and cache.row_blocks(30, prefill=13) == 4  # 6 keys; 13 tokens
    assert cache.row_blocks(6) == 2 and PagedCache(1, 40, block_size=4).row_blocks(30, prefill=6) == 8
    rows = cache.allocate(2, 30, prefill=6)
    assert cache.available == 8 - 6
    cache.begin(rows, 6, "cpu")  # both prefill 6 tokens
    cache.append(1, torch.arange(12.0).view(6, 2, 1))
    cache.advance()
    for step in range(3):  # lengths 6, 7, 8: the queries look back to 1, 2, 3: block 1 stays
        cache.begin(rows[:1], 1, "cpu")
        cache.append(1, torch.full((1, 1, 1), 100.0 + step))
        cache.advance()
    assert cache.tables[0] == [1, 2, 5] and cache.first_key == 0
    positions, mask = cache.begin(rows, 1, "cpu")  # row 0 at 9 looks back to 4: block 1 is returned
    assert cache.tables[0] == [0, 2, 5] and cache.free_blocks[-1] == 1 and cache.first_key == 0  # row 1 at 6
    assert positions.tolist() == [[9], [6]] and mask.shape == (2, 1, 1, 10)
    (keys,) = cache.append(1, torch.tensor([[[-1.0], [-2.0]]]))
    cache.advance()
    assert keys[:4, 0, 0].tolist() == [0.0] * 4  # read from the zero block (the window masks them)
    assert keys[4:, 0, 0].tolist() == [8.0, 10.0, 100.0, 101.0, 102.0, -1.0]
    assert cache.available == 2 and cache.promised == 2  # each row: 2 blocks held, 1 more promised
    cache.release(rows[1:])
    positions, mask = cache.begin(rows[:1], 1, "cpu")  # alone at 10: reads from position 4 on
    assert cache.first_key == 4 and mask.shape == (1, 1, 1, 7)
    (keys,) = cache.append(1, torch.full((1, 1, 1), -3.0))
    assert keys[:, 0, 0].tolist() == [8.0, 10.0, 100.0, 101.0, 102.0, -1.0, -3.0]
    cache.release(rows[:1])
    assert sorted(cache.free_blocks) == list(range(1, 9)) and cache.available == 8


def test_generation_past_the_window_equals_no_cache_with_fewer_blocks():
    """Every layer windowed (4 keys back), blocks of 4: a row holds at most 3 blocks (2 after a short
    prefill) where its whole sequence needs 9, so a pool of 8 runs two requests (three rows) at once,
    at different lengths; chunked prefill."""
    model = windowed_model(window=(4, 0), skip=None)
    g = torch.Generator().manual_seed(4)
    prompt = [torch.randint(0, 99, (n,), generator=g).tolist() for n in (7, 5, 9)]
    requests = [([prompt[0]], SamplingParams(tokens_to_generate=30, top_k=1, top_n_logprobs=2)),
                ([prompt[1], prompt[2]], SamplingParams(tokens_to_generate=26, temperature=1.2, top_k=6,
                                                        random_seed=7))]
    reference = InferenceEngine(model, vocab_size=100, max_sequence_length=48, use_cache=False)
    alone = [reference.generate(p, params) for p, params in requests]
    assert len(alone[0][0].tokens) == 37 and len(alone[1][1].tokens) == 35  # far past the window
    engine = InferenceEngine(model, vocab_size=100, max_sequence_length=48)
    scheduler = Scheduler(engine, 3, block_size=4, num_blocks=8, max_batched_tokens=4)
    assert [scheduler.cache.row_blocks(36, 7), scheduler.cache.row_blocks(34, 5)] == [3, 2]
    held = []
    original = scheduler.cache.advance

    def advance():
        held.append(scheduler.cache.num_blocks - len(scheduler.cache.free_blocks))
        original()

    scheduler.cache.advance = advance
    results, ended, _ = run(scheduler, requests, [0, 3])
    for rid in range(2):
        assert_same(alone[rid], results[rid])
    assert 3 < max(held) <= 3 + 2 + 2  # the requests' rows held blocks together, never a whole row's 9


def test_a_shared_block_beyond_one_rows_window_stays_while_another_row_holds_it():
    """Prefix caching with every layer windowed: a row starts after a cached prefix holding only the
    blocks its window reaches; a block it shares goes back to the pool (still named) only when the
    last row holding it drops it; each row is promised its whole window cap."""
    cache = PagedCache(2, 40, block_size=2, num_blocks=12, prefix_caching=True, reach=3)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    (a,) = cache.allocate(1, 10, [prompt], 6)
    cache.begin([a], 7, "cpu")
    cache.append(1, torch.zeros(7, 1, 1))
    cache.advance()  # blocks 1, 2, 3 named (tokens 0..5), block 4 half full
    (b,) = cache.allocate(1, 10, [prompt[:6] + [9, 9]], 7)  # finds 3 blocks: 6 tokens, window reaches 3..5
    assert cache.lengths[b] == 6 and cache.tables[b] == [0, 2, 3] and cache.refs[2:4] == [2, 2]
    assert cache.reserved[a:b + 1] == [4, 5] and cache.available == 12 - 4 - 5  # shared blocks counted too
    cache.begin([a, b], 1, "cpu")  # a at 7 drops blocks 1 and 2 (to 3); b at 6 drops block 1 (not its)
    cache.append(1, torch.zeros(1, 2, 1))
    cache.advance()
    assert cache.tables[a][:3] == [0, 0, 3] and cache.refs[1:4] == [0, 1, 2] and 1 in cache.free_blocks
    assert 2 not in cache.free_blocks and cache.tables[b][:3] == [0, 2, 3]
    cache.begin([b], 1, "cpu")  # b at 7: now block 2 is nobody's: back to the pool, still named
    assert cache.refs[2] == 0 and cache.free_blocks[-1] == 2 and cache.names[2] in cache.cached
    cache.release([a, b])
    assert sorted(cache.free_blocks) == list(range(1, 13)) and cache.available == 12


def test_shared_prefixes_past_the_window_answer_as_each_request_alone():
    """Every layer windowed (4 keys back), blocks of 4, prefix caching: the 2nd request reuses the
    1st's first 3 blocks while the 1st still holds the 3rd (it drops it a step later than the 2nd),
    the 3rd request's two equal choices share their prompt blocks and reuse 4 cached ones (the 2nd's
    4th too, long gone from its window, back in the pool still named); a pool of 16 blocks (the 3rd
    waits for the 2nd to end: every row is promised its window cap). Tokens and log-probs equal each request alone,
    blocks go back as rows pass them, and every block's count is the tables holding it."""
    model = windowed_model(window=(4, 0), skip=None)
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(0, 99, (13,), generator=g).tolist()
    tail = torch.randint(0, 99, (8,), generator=g).tolist()
    off = dict(prompt_log_probs=False)
    requests = [([shared + [3]], SamplingParams(tokens_to_generate=20, top_k=1, top_n_logprobs=2, **off)),
                ([shared[:12] + tail], SamplingParams(tokens_to_generate=12, top_k=1, **off)),
                ([shared[:12] + tail[:5]] * 2, SamplingParams(tokens_to_generate=10, temperature=1.2, top_k=6,
                                                              random_seed=7, **off))]
    reference = InferenceEngine(model, vocab_size=100, max_sequence_length=48, use_cache=False)
    alone = [reference.generate(p, params) for p, params in requests]
    engine = InferenceEngine(model, vocab_size=100, max_sequence_length=48)
    scheduler = Scheduler(engine, 3, block_size=4, num_blocks=16, prefix_caching=True)
    cache, held = scheduler.cache, []
    original = cache.advance

    def advance():
        counts = [sum(t.count(b) for t in cache.tables) for b in range(cache.num_blocks + 1)]
        assert counts[1:] == cache.refs[1:] and not any(counts[b] for b in cache.free_blocks)
        held.append(cache.num_blocks - len(cache.free_blocks))
        original()

    cache.advance = advance
    results, ended, _ = run(scheduler, requests, [0, 1, 2])
    assert ended[2] > ended[1]  # the 3rd waited for the 2nd's rows' caps
    for rid, cached in enumerate([0, 12, 16]):
        assert_same(alone[rid], results[rid], cached)
    assert cache.reused_tokens == 12 + 2 * 16 and max(held) < 16
    assert sorted(cache.free_blocks) == list(range(1, 17)) and cache.available == 16
