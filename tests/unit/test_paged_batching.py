"""The paged key/value cache and chunked prefill of continuous batching (inference/paged_cache.py,
scheduler.py) in one process.

A request's tokens (greedy and seeded) and log-probs (1e-5) equal those it gets alone, for GPT,
grouped-query attention with RoPE and MLA's latent cache, with blocks of 4 tokens and at most 6
tokens per step, so prompts cross block and chunk boundaries; a request whose blocks are not free
waits (rows free or not) and then runs; one that can never fit is refused (HTTP 400 naming the
flag); every block is back in the pool after requests finish, fail or are cancelled (mid-prefill
included); a long prompt's chunks leave the decoding request a token at every step.
"""

import pytest

from megatron_lite.inference.sampling import SamplingParams
from megatron_lite.inference.scheduler import Scheduler
from tests.batching_helpers import (
    JOINS,
    PAGED,
    all_blocks_back,
    assert_same,
    batching_requests,
    run,
    saved_engines,
)
from tests.inference_helpers import VOCAB, prompts


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    return saved_engines(str(tmp_path_factory.mktemp("paged")), ("gpt", "rope_gqa", "mla_mtp"))



def watched(scheduler):
    """``scheduler`` recording the tokens fed per step (``fed``) and whether a queued request waited
    for blocks while enough rows were free (``waited_for_blocks``)."""
    scheduler.fed, scheduler.waited_for_blocks = [], False
    begin, run_step = scheduler.cache.begin, scheduler.run_step

    def counting_begin(rows, s_new, *args, **kwargs):
        scheduler.fed[-1].append(s_new * len(rows))
        return begin(rows, s_new, *args, **kwargs)

    def watched_step():
        scheduler.fed.append([])
        events = run_step()
        head = scheduler.pending[0] if scheduler.pending else None
        if head is not None and len(head.prompts) <= len(scheduler.cache.free):
            scheduler.waited_for_blocks = True
        return events

    scheduler.cache.begin, scheduler.run_step = counting_begin, watched_step
    return scheduler


@pytest.mark.parametrize("variant", ["gpt", "rope_gqa", "mla_mtp"])
def test_paged_chunked_batch_equals_each_request_alone(engines, variant):
    engine = engines[variant]
    long = ([prompts(1, seed=3, lengths=(23,))[0]],
            SamplingParams(tokens_to_generate=6, top_k=1, top_n_logprobs=2, step_log_probs=True))
    requests = batching_requests() + [long]
    alone = [engine.generate(p, params) for p, params in requests]
    scheduler = watched(Scheduler(engine, 6, **PAGED))
    results, _, events = run(scheduler, requests, JOINS + [6])
    for i in range(len(requests)):
        assert_same(alone[i], results[i])
    assert max(sum(f) for f in scheduler.fed) <= PAGED["max_batched_tokens"]
    assert any(1 < s < 23 for f in scheduler.fed for s in f)  # a prefill ran in chunks
    assert scheduler.waited_for_blocks  # rows were free, blocks were not
    assert all_blocks_back(scheduler.cache) and scheduler.cache.free == list(range(6))
    streamed = [e.step for e in events if e.rid == 4]  # the chunks' log-probs reach the stream, once each
    joined = sum((s.log_probs[0] for s in streamed), [])
    assert streamed[0].start == 0 and joined[:len(results[4][0].log_probs)] == results[4][0].log_probs
    assert [t for s in streamed if (t := s[0]) is not None] == results[4][0].generated


def test_a_long_prompt_prefills_in_chunks_while_another_request_decodes(engines):
    engine = engines["gpt"]
    decoding = ([prompts(1, lengths=(3,))[0]], SamplingParams(tokens_to_generate=30, top_k=1, stop_on_eod=False))
    long = ([prompts(1, seed=4, lengths=(40,))[0]], SamplingParams(tokens_to_generate=3, top_k=1, top_n_logprobs=1))
    steps = {}
    for budget in (None, 4):
        results, ended, events = run(Scheduler(engine, 2, max_batched_tokens=budget), [decoding, long], [0, 3])
        assert_same(engine.generate(*long), results[1]) and assert_same(engine.generate(*decoding), results[0])
        first = min(i for i, e in enumerate(events) if e.rid == 1)  # the long request's first step
        before = [e for e in events[:first] if e.rid == 0]
        steps[budget] = len(before)
        assert all(e.step[0] is not None for e in before)  # the decoding request got a token every step
    assert steps == {None: 4, 4: 4 + 13}  # joined at step 3; chunked 3 tokens a step (1 goes to decoding): 14 steps


def test_a_request_waits_for_blocks_and_one_that_can_never_fit_is_refused(engines):
    engine = engines["gpt"]
    first = ([prompts(1, lengths=(9,))[0]], SamplingParams(tokens_to_generate=8, top_k=1, stop_on_eod=False))
    second = ([prompts(1, seed=1)[0]], SamplingParams(tokens_to_generate=7, top_k=1, stop_on_eod=False))
    scheduler = watched(Scheduler(engine, 4, block_size=4, num_blocks=6))  # 16 tokens: 4 blocks; 11: 3
    results, ended, _ = run(scheduler, [first, second], [0, 0])
    assert scheduler.waited_for_blocks and ended == {0: 7, 1: 8 + 6}  # second starts when first ends
    assert_same(engine.generate(*first), results[0]) and assert_same(engine.generate(*second), results[1])
    assert all_blocks_back(scheduler.cache)
    with pytest.raises(ValueError, match="needs 8 key/value-cache blocks of 4 tokens .2 sequence.s. of up to 16 "
                                         "tokens., more than the 6 of --inference-kv-cache-blocks; raise it"):
        scheduler.add(first[0] * 2, first[1])
    assert not scheduler.busy


def test_a_request_too_big_for_the_blocks_is_an_http_400(engines):
    pytest.importorskip("flask")
    from megatron_lite.data.tokenizers import build_tokenizer
    from megatron_lite.inference.batch_runner import BatchRunner
    from megatron_lite.inference.server import create_app

    runner = BatchRunner(engines["gpt"], 4, block_size=4, num_blocks=3)
    with pytest.raises(ValueError, match="--inference-kv-cache-blocks"):  # refused when handed over, never queued
        runner.submit([[1, 2, 3]], SamplingParams(tokens_to_generate=20))
    client = create_app(runner, build_tokenizer("NullTokenizer", vocab_size=VOCAB - 1)).test_client()
    answer = client.post("/v1/completions", json={"prompt": "1 2 3", "max_tokens": 20})
    assert answer.status_code == 400 and "--inference-kv-cache-blocks" in answer.get_json()["error"]["message"]
    assert not runner.busy


@pytest.mark.parametrize("after", [1, 3])  # cancelled mid-way through its chunked prefill, or decoding
def test_a_cancelled_request_gives_its_blocks_back(engines, after):
    from megatron_lite.inference.batch_runner import BatchRunner

    engine = engines["gpt"]
    runner = BatchRunner(engine, 2, block_size=4, num_blocks=12, max_batched_tokens=8)
    request = ([prompts(1, lengths=(20,))[0]], SamplingParams(tokens_to_generate=20, top_k=1, stop_on_eod=False))
    steps = runner.stream(*request)
    for _ in range(after):
        runner.work()
    assert runner.batch.cache.free_blocks != list(range(1, 13))
    steps.cancel()
    runner.work()
    assert not runner.busy and all_blocks_back(runner.batch.cache)
    again = runner.stream(*request)  # the blocks serve the next request
    while runner.work():
        pass
    assert [t for (t,) in again] == engine.generate(*request)[0].generated and all_blocks_back(runner.batch.cache)


def test_the_paged_cache_flags(tmp_path, capsys):
    from tests.tools import load_tool

    tool = load_tool("run_text_generation_server")
    args = tool.parse_args(["--load", "x"])
    assert (args.inference_dynamic_batching_block_size, args.inference_kv_cache_blocks,
            args.max_num_batched_tokens) == (16, None, 512)
    # docs/inference.md: prefix caching on by default (vLLM's), off with --no-enable-prefix-caching; 127.0.0.1
    assert args.enable_prefix_caching is True and args.host == "127.0.0.1"
    assert tool.parse_args(["--load", "x", "--no-enable-prefix-caching"]).enable_prefix_caching is False
    for flags, message in (
            (["--inference-dynamic-batching-block-size", "0"], "--inference-dynamic-batching-block-size 0 must be "
                                                               "at least 1"),
            (["--inference-kv-cache-blocks", "0"], "--inference-kv-cache-blocks 0 must be at least 1"),
            (["--max-num-batched-tokens", "4"], "--max-num-batched-tokens 4 must be at least --inference-max-requests "
                                                "8 (each decoding sequence feeds one token per step); raise it")):
        assert tool.main(["--load", str(tmp_path), *flags]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {message}")



@pytest.mark.parametrize("off", [["--inference-max-requests", "1"], ["--no-kv-cache"]])
@pytest.mark.parametrize("flag, value", [("--max-num-batched-tokens", "64"),
                                         ("--inference-dynamic-batching-block-size", "4"),
                                         ("--inference-kv-cache-blocks", "100")])
def test_the_paged_cache_flags_where_nothing_batches_are_refused(tmp_path, capsys, off, flag, value):
    """One request at a time (--inference-max-requests 1, --no-kv-cache) runs no paged cache and no
    chunked prefill: a flag for them was accepted and ignored; it exits 2 naming both flags."""
    from tests.tools import load_tool

    tool = load_tool("run_text_generation_server")
    assert tool.main(["--load", str(tmp_path), *off, flag, value]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {flag} sets continuous batching's") and off[0] in lines[0]
    assert tool.parse_args(["--load", "x", *off]).max_num_batched_tokens == 512  # the defaults alone are fine



@pytest.mark.parametrize("budget", [None, 6])
def test_mla_rows_of_different_lengths_in_the_paged_cache_equal_each_row_alone(engines, budget):
    """MLA's latent cache in paged blocks of 4, rows of 3, 10 and 17 tokens (one block, crossing two,
    five) prefilled in one step or in chunks of at most 6 tokens: as one request (its rows teacher-forced
    in step) and as three requests (one joining at step 2, so rows sit at different positions and the
    shorter ones' keys are masked), each row gets the tokens and log-probs (1e-5) it gets generated alone."""
    engine = engines["mla_mtp"]
    rows = prompts(3, seed=7, lengths=(3, 10, 17))
    params = SamplingParams(tokens_to_generate=6, top_k=1, top_n_logprobs=2, step_log_probs=True, stop_on_eod=False)
    alone = [engine.generate([row], params)[0] for row in rows]
    for requests, joins in (([(rows, params)], [0]), ([([row], params) for row in rows], [0, 0, 2])):
        scheduler = Scheduler(engine, 4, block_size=4, num_blocks=18, max_batched_tokens=budget)
        results, _, _ = run(scheduler, requests, joins)
        assert_same(alone, [r for i in range(len(requests)) for r in results[i]])
        assert all_blocks_back(scheduler.cache)
