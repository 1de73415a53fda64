"""``run_ranks(2, specdec_ranks.speculative_answers, root)`` (tests/harness.py's process pool): speculative
decoding at TP2 through the server's runner without HTTP. Rank 0 hands ``REQUESTS`` to a
:class:`~megatron_lite.inference.batch_runner.BatchRunner` over a ``SpeculativeEngine`` with
``fall_back`` (the server's ``--num-speculative-tokens 1``): the one-prompt requests run alone with
drafts on both ranks (rank 1 follows the broadcast job), and so does the two-prompt one, as one
speculative batch (its sequences keep their own drafts). The drafter
of the greedy requests is an oracle: the main model's greedy token after its context (one forward
pass of the engine, a collective both ranks run alike), but a wrong one every third draft, so rounds
keep their draft or refuse it; the sampled request draws its drafts on each rank. Every rank returns the results of the requests it ran with drafts and the engine's
``served``; rank 0 also every request's answer."""

import json

import torch

from megatron_lite.inference.batch_runner import BatchRunner
from megatron_lite.inference.loading import load_model
from megatron_lite.inference.sampling import SamplingParams
from megatron_lite.inference.speculative import MTPDrafter, SpeculativeEngine
from tests.harness import cached_state
from tests.inference_helpers import MAX_LEN, VOCAB

REQUESTS = [
    ([[5, 17, 42, 8]], SamplingParams(tokens_to_generate=12, top_k=1, top_n_logprobs=2)),
    ([[3, 1, 4, 1, 5, 9]], SamplingParams(tokens_to_generate=10, top_k=1, stop_on_eod=False)),
    ([[5, 6, 7, 8, 9]], SamplingParams(tokens_to_generate=8, temperature=1.2, top_k=4, random_seed=3)),  # sampled
    ([[2, 7], [1, 8, 2, 8]], SamplingParams(tokens_to_generate=6, top_k=1)),  # two prompts: one speculative batch
]
GREEDY = [0, 1, 3]  # the requests whose tokens one process gives too


def as_json(results) -> list:
    return [{"tokens": g.tokens, "log_probs": g.log_probs, "finish_reason": g.finish_reason} for g in results]


def oracle_pick(engine, healthy):
    calls = []

    def pick(self, logits, depth, context):
        if self.params.top_k != 1:  # sampled: the depth's own draw (its distribution is needed)
            return healthy(self, logits, depth, context)
        best = int(engine.forward(torch.tensor([context], device=engine.device))[0, -1].argmax())
        calls.append(depth)
        return (best if len(calls) % 3 else (best + 1) % VOCAB), None

    return pick


def speculative_answers(root: str) -> dict:
    """On each of 2 ranks of a pool: see the module docstring."""
    state = cached_state(tp=2, pp=1)
    model, _ = load_model(root, state)
    engine = SpeculativeEngine(model, state, num_speculative_tokens=1, fall_back=True, vocab_size=VOCAB,
                               max_sequence_length=MAX_LEN, eod=VOCAB - 1)
    healthy = MTPDrafter.pick
    MTPDrafter.pick = oracle_pick(engine, healthy)
    drafted = []  # the results of what ran with drafts (on rank 1: the jobs it followed)
    speculative = engine._speculative_steps

    def recording(prompts, params, cancelled=None):
        results = yield from speculative(prompts, params, cancelled)
        drafted.extend(results)
        return results

    engine._speculative_steps = recording
    try:
        runner = BatchRunner(engine, 4)
        out = {}
        if state.rank == 0:
            tickets = [runner.submit(*request) for request in REQUESTS]
            while runner.busy:
                runner.work()
            out["answers"] = [as_json(ticket.result()) for ticket in tickets]
            runner.stop()
        else:
            runner.follow()
    finally:
        MTPDrafter.pick = healthy
    out.update(drafted=as_json(drafted), served=engine.served)
    return json.loads(json.dumps(out))
