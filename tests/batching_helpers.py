"""Continuous batching's test requests and driver, shared by the unit tests and the torchrun script
(tests/e2e/contbatch_ranks.py)."""

import os

import torch

from megatron_lite.inference.engine import InferenceEngine
from megatron_lite.inference.loading import load_model
from megatron_lite.inference.sampling import SamplingParams
from tests.inference_helpers import MAX_LEN, VOCAB, assert_close, prompts, save_model

JOINS = [0, 2, 5, 5]  # the step before which request i joins (two at once at step 5)
# A paged cache that makes these requests cross block and chunk boundaries and wait for blocks:
# blocks of 4 tokens, 16 of them (requests 0 and 1 hold 15), at most 6 tokens per step.
PAGED = dict(block_size=4, num_blocks=16, max_batched_tokens=6)


def saved_engines(root: str, variants) -> dict:
    """An inference engine per model variant (tests/inference_helpers.py), each saved under ``root`` and loaded back."""
    out = {}
    for variant in variants:
        save_model(variant, os.path.join(root, variant))
        model, _ = load_model(os.path.join(root, variant))
        out[variant] = InferenceEngine(model, vocab_size=VOCAB, max_sequence_length=MAX_LEN, eod=VOCAB - 1)
    return out


def all_blocks_back(cache) -> bool:
    """Every block of a paged cache is back in its pool, none promised."""
    return sorted(cache.free_blocks) == list(range(1, cache.num_blocks + 1)) and cache.available == cache.num_blocks


def batching_requests():
    """Requests that could break batching: prompts of different lengths in one request (teacher
    forcing), seeded samples with top-k / top-p, penalties, logit_bias, a stop token, log-probs."""
    p = prompts(6)
    return [
        ([p[0]], SamplingParams(tokens_to_generate=24, top_k=1, top_n_logprobs=2)),
        ([p[1], p[2]], SamplingParams(tokens_to_generate=7, temperature=1.3, top_k=5, random_seed=3)),
        ([p[3]], SamplingParams(tokens_to_generate=9, top_p=0.9, random_seed=5, presence_penalty=0.5,
                                frequency_penalty=0.3, logit_bias=((4, 2.0), (9, -5.0)))),
        ([p[4][:3], p[5]], SamplingParams(tokens_to_generate=5, top_k=1, step_log_probs=True)),
    ]


# A request whose first sequence ends at a stop string spanning tokens (GPT's greedy text " 98 12 50 ...",
# MLA's " 22 72 37 54 ...": at their third and fourth tokens) and whose second runs to its end; its
# engine needs the tokenizer (the torchrun script joins it at step 1).
STOPPING = ([[5, 17, 42, 8], [2, 7, 1]], SamplingParams(tokens_to_generate=10, top_k=1, stop_strings=("2 5", "7 5")))


# Prompts sharing a 13-token prefix across blocks of 4 (PAGED), their answers without prompt log-probs
# (OpenAI's without echo), so prefix caching may skip cached blocks: the second shares 2 blocks with
# the first, the third (n=2, seeded) 3 per choice (its last prompt token is always computed), the
# fourth (8 tokens, 2 whole blocks) 1; the last asks for prompt log-probs and reuses nothing.
SHARED = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9]
PREFIX_JOINS = [0, 3, 3, 4, 4]
PREFIX_CACHED = [0, 8, 12, 4, 0]  # prompt tokens each request takes from the cache
PREFIX_REUSED = 8 + 2 * 12 + 4  # prompt tokens not prefilled


def prefix_requests():
    return [([SHARED], SamplingParams(tokens_to_generate=5, top_k=1, top_n_logprobs=2, prompt_log_probs=False)),
            ([SHARED[:10] + [7, 7]], SamplingParams(tokens_to_generate=4, top_k=1, prompt_log_probs=False)),
            ([SHARED, SHARED], SamplingParams(tokens_to_generate=6, temperature=1.1, top_k=4, random_seed=9,
                                              step_log_probs=True, prompt_log_probs=False)),
            ([SHARED[:8]], SamplingParams(tokens_to_generate=3, top_k=1, prompt_log_probs=False)),
            ([SHARED], SamplingParams(tokens_to_generate=3, top_k=1, top_n_logprobs=1))]


def chat_turn(answer: list[int]):
    """The next turn of the first prefix request's chat: its whole sequence (SHARED and 5 greedy
    tokens: 18, the last never written) and two more tokens. After prefix_requests() it finds 4
    named blocks, the 4th holding 3 of the answer's tokens (written as it decoded)."""
    return [answer + [7, 7]], SamplingParams(tokens_to_generate=3, top_k=1, prompt_log_probs=False)


CHAT_CACHED = 16


def run(scheduler, requests, joins):
    """Run ``requests`` (request i added before step ``joins[i]``) to the end: (results, the step
    each ended at, the events)."""
    results, ended, events, step = {}, {}, [], 0
    while step <= max(joins) or scheduler.busy:
        for i, at in enumerate(joins):
            if at == step:
                assert scheduler.add(*requests[i]) == i
        for event in scheduler.run_step():
            events.append(event)
            assert event.error is None
            if event.results is not None:
                results[event.rid], ended[event.rid] = event.results, step
        step += 1
    return results, ended, events


def assert_same(alone, batched, cached=0):
    """Equal answers; the first ``cached`` log-probs of each batched one (a prompt prefix taken from
    the prefix cache) must be NaN (not computed), and only they."""
    assert [r.tokens for r in batched] == [r.tokens for r in alone]
    assert [r.finish_reason for r in batched] == [r.finish_reason for r in alone]
    for a, b in zip(alone, batched):
        got = torch.tensor(b.log_probs)
        assert got[:cached].isnan().all() and not got[cached:].isnan().any()
        assert_close(got[cached:], torch.tensor(a.log_probs)[cached:])
        if a.top_log_probs is not None:
            top = [[t for t, _ in pos] for pos in b.top_log_probs]
            assert top[cached:] == [[t for t, _ in pos] for pos in a.top_log_probs][cached:]
