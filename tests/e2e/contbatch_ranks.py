"""``torchrun --nproc-per-node 2 contbatch_ranks.py OUT ROOT...``: continuous batching at TP2
(``CONTBATCH_LAYOUT=1,2``: PP2), with the paged cache and chunked prefill of ``PAGED`` (blocks of 4
tokens, too few for every request at once, at most 6 tokens per step), through the server's runner without HTTP (rank 0 hands the requests over at fixed steps, decides
each step's admissions and broadcasts them; rank 1 follows), over each checkpoint ROOT: the
requests of ``batching_requests()``, then ``STOPPING`` (joining at step 1; a stop string ends one of
its sequences, which the sampling rank decides and broadcasts: the engines hold the tokenizer), then
``prefix_requests()`` (joining from step 8; prefix caching is on, so they start after the prompt blocks
the earlier ones computed), then ``chat_turn()`` (the first prefix request's sequence and more, sent
when it has answered: it reuses that answer's full blocks too). Rank 0
writes every request's results to OUT (JSON: root -> requests -> sequences), then the prompt tokens the prefix cache saved. ``CONTBATCH_FAIL=1``
adds a request (seed 13, joining at step 3) whose sampling raises on the sampling rank: its entry is
``{"error": message}`` as rank 0 got it."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository root

from megatron_lite.data.tokenizers import build_tokenizer  # noqa: E402
from megatron_lite.device import init_distributed  # noqa: E402
from megatron_lite.inference import scheduler  # noqa: E402
from megatron_lite.inference.batch_runner import BatchRunner  # noqa: E402
from megatron_lite.inference.engine import InferenceEngine  # noqa: E402
from megatron_lite.inference.loading import load_model  # noqa: E402
from megatron_lite.inference.sampling import SamplingParams  # noqa: E402
from megatron_lite.parallel.state import ParallelState  # noqa: E402
from tests.batching_helpers import (  # noqa: E402
    JOINS,
    PAGED,
    PREFIX_JOINS,
    STOPPING,
    batching_requests,
    chat_turn,
    prefix_requests,
)
from tests.inference_helpers import MAX_LEN, VOCAB  # noqa: E402

FAILING = ([[5, 6, 7, 8, 9]], SamplingParams(tokens_to_generate=6, top_k=3, random_seed=13))


def fail_seed_13() -> None:
    """Make the sampling of every request seeded 13 raise (a per-request failure inside a step)."""
    healthy = scheduler.BatchRequest.sample

    def sample(self, logits):
        if self.params.random_seed == 13:
            raise RuntimeError("logits processor failed")
        return healthy(self, logits)

    scheduler.BatchRequest.sample = sample


def answer(ticket) -> list | dict:
    try:
        return [{"tokens": g.tokens, "log_probs": g.log_probs, "finish_reason": g.finish_reason}
                for g in ticket.result()]
    except RuntimeError as err:
        return {"error": str(err)}


def serve_requests(runner: BatchRunner) -> list:
    requests, tickets, step = batching_requests() + [STOPPING] + prefix_requests(), {}, 0
    joins = list(JOINS) + [1] + [8 + at for at in PREFIX_JOINS]
    if os.environ.get("CONTBATCH_FAIL"):
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


def main(out: str, roots: list[str]) -> None:
    device = init_distributed()
    tp, pp = (int(x) for x in os.environ.get("CONTBATCH_LAYOUT", "2,1").split(","))  # TP,PP (2 ranks)
    state = ParallelState(tp=tp, pp=pp)
    if os.environ.get("CONTBATCH_FAIL"):
        fail_seed_13()
    answers = {}
    for root in roots:
        model, _ = load_model(root, state, device=device)
        engine = InferenceEngine(model, state, vocab_size=VOCAB, max_sequence_length=MAX_LEN, eod=VOCAB - 1,
                                 tokenizer=build_tokenizer("NullTokenizer", vocab_size=VOCAB - 1))
        runner = BatchRunner(engine, 6, **PAGED, prefix_caching=True)
        if state.rank == 0:
            answers[root] = serve_requests(runner) + [runner.batch.cache.reused_tokens]
            cache = runner.batch.cache
            assert sorted(cache.free_blocks) == list(range(1, cache.num_blocks + 1)), "blocks lost"
        else:
            runner.follow()
    if state.rank == 0:
        with open(out + ".tmp", "w") as f:
            json.dump(answers, f)
        os.replace(out + ".tmp", out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
