"""``run_ranks(2, contbatch_ranks.batched_answers, roots, tp, pp, fail)`` (tests/harness.py's process pool):
continuous batching at TP2 (``tp, pp = 1, 2``: PP2), with the paged cache and chunked prefill of ``PAGED`` (blocks of 4
tokens, too few for every request at once, at most 6 tokens per step), through the server's runner without HTTP (rank 0 hands the requests over at fixed steps, decides
each step's admissions and broadcasts them; rank 1 follows), over each checkpoint ROOT: the
requests of ``batching_requests()``, then ``STOPPING`` (joining at step 1; a stop string ends one of
its sequences, which the sampling rank decides and broadcasts: the engines hold the tokenizer), then
``prefix_requests()`` (joining from step 8; prefix caching is on, so they start after the prompt blocks
the earlier ones computed), then ``chat_turn()`` (the first prefix request's sequence and more, sent
when it has answered: it reuses that answer's full blocks too). Rank 0
returns every request's results (JSON-shaped: root -> requests -> sequences), then the prompt tokens the prefix cache saved;
rank 1 returns None. ``fail``
adds a request (seed 13, joining at step 3) whose sampling raises on the sampling rank: its entry is
``{"error": message}`` as rank 0 got it."""

import json

from megatron_lite.data.tokenizers import build_tokenizer
from megatron_lite.inference import scheduler
from megatron_lite.inference.batch_runner import BatchRunner
from megatron_lite.inference.engine import InferenceEngine
from megatron_lite.inference.loading import load_model
from megatron_lite.inference.sampling import SamplingParams
from tests.batching_helpers import (
    JOINS,
    PAGED,
    PREFIX_JOINS,
    STOPPING,
    batching_requests,
    chat_turn,
    prefix_requests,
)
from tests.harness import cached_state
from tests.inference_helpers import MAX_LEN, VOCAB

FAILING = ([[5, 6, 7, 8, 9]], SamplingParams(tokens_to_generate=6, top_k=3, random_seed=13))


def fail_seed_13():
    """Make the sampling of every request seeded 13 raise (a per-request failure inside a step); returns
    the healthy method, to put back (the pool's workers serve other tests after this one)."""
    healthy = scheduler.BatchRequest.sample

    def sample(self, logits):
        if self.params.random_seed == 13:
            raise RuntimeError("logits processor failed")
        return healthy(self, logits)

    scheduler.BatchRequest.sample = sample
    return healthy


def answer(ticket) -> list | dict:
    try:
        return [{"tokens": g.tokens, "log_probs": g.log_probs, "finish_reason": g.finish_reason}
                for g in ticket.result()]
    except RuntimeError as err:
        return {"error": str(err)}


def serve_requests(runner: BatchRunner, fail: bool) -> list:
    requests, tickets, step = batching_requests() + [STOPPING] + prefix_requests(), {}, 0
    joins = list(JOINS) + [1] + [8 + at for at in PREFIX_JOINS]
    if fail:
        requests, joins = requests + [FAILING], joins + [3]
    while step <= max(joins) or runner.busy:
        for i, at in enumerate(joins):
            if at == step:
                tickets[i] = runner.submit(*requests[i])
        runner.work()
        step += 1
    answers = [answer(tickets[i]) for i in range(len(requests))]  # a ticket's results are read once
    turn = runner.submit(*chat_turn(answers[len(JOINS) + 1][0]["tokens"]))  # the first prefix request's
    while runner.busy:
        runner.work()
    runner.stop()
    return answers + [answer(turn)]


def batched_answers(roots: list[str], tp: int, pp: int, fail: bool = False) -> dict | None:
    """On each of 2 ranks of a pool: see the module docstring."""
    state = cached_state(tp=tp, pp=pp)
    healthy = fail_seed_13() if fail else None
    try:
        out = {}
        for root in roots:
            model, _ = load_model(root, state)
            engine = InferenceEngine(model, state, vocab_size=VOCAB, max_sequence_length=MAX_LEN, eod=VOCAB - 1,
                                     tokenizer=build_tokenizer("NullTokenizer", vocab_size=VOCAB - 1))
            runner = BatchRunner(engine, 6, **PAGED, prefix_caching=True)
            if state.rank == 0:
                out[root] = serve_requests(runner, fail) + [runner.batch.cache.reused_tokens]
                cache = runner.batch.cache
                assert sorted(cache.free_blocks) == list(range(1, cache.num_blocks + 1)), "blocks lost"
            else:
                runner.follow()
    finally:
        if healthy is not None:
            scheduler.BatchRequest.sample = healthy
    return json.loads(json.dumps(out)) if state.rank == 0 else None  # as plain as a JSON file would give them
