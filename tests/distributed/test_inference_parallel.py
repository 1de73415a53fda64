"""Generation at TP2, PP2 and TP2 x PP2 gives the one-process tokens and log-probs.

Beam search at TP2 x PP2 (MLA) equals one process too.

Every rank loads its slice of the same checkpoint (a one-process ``torch`` checkpoint, the same
saved as ``torch_dist``, and one written at TP2 x PP2: the layout it was "trained" at) and runs the
engine; the tokens and log-probs every rank returns must equal the single-process engine's
(log-probs within 1e-5 relative to the largest, as in tests/unit/test_inference_engine.py).
The DeepSeek-V3-shaped model (MLA + MTP) runs at TP2 and TP2 x PP2, the MoE model at PP2, TP2 (3 prompts:
an odd token count for 2 TP ranks while decoding) and TP2 x PP2. Greedy and seeded top-k sampling: the last stage samples and broadcasts, so a sampled token
reaches the first stage and every rank. With ``step_log_probs`` (streamed log-probs) every rank at
TP2 x PP2 gets each step's log-probs as they come, equal to the final ones."""

import pytest
import torch

from megatron_lite.checkpoint.reshard import TargetLayout, load_megatron, save_megatron
from megatron_lite.inference.engine import InferenceEngine
from megatron_lite.inference.loading import load_model
from megatron_lite.inference.sampling import SamplingParams
from tests.harness import cached_state, run_ranks
from tests.inference_helpers import MAX_LEN, VOCAB, assert_close, prompts, save_model

NEW = 16


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel_inference")
    out = {}
    for variant in ("gpt", "rope_gqa", "moe", "mla_mtp"):
        out[variant] = str(root / variant)
        save_model(variant, out[variant])
    out["gpt_dist"] = str(root / "gpt_dist")
    save_model("gpt", out["gpt_dist"], ckpt_format="torch_dist")
    out["rope_gqa_tp2pp2"] = str(root / "rope_gqa_tp2pp2")
    save_megatron(load_megatron(out["rope_gqa"]), out["rope_gqa_tp2pp2"], TargetLayout(tp=2, pp=2))
    return out


def _params(top_k):
    return SamplingParams(tokens_to_generate=NEW, top_k=top_k, random_seed=5, stop_on_eod=False)


def generate_on_ranks(root, tp, pp, top_k):
    state = cached_state(tp=tp, pp=pp)
    model, _ = load_model(root, state)
    engine = InferenceEngine(model, state, vocab_size=VOCAB, max_sequence_length=MAX_LEN, eod=VOCAB - 1)
    return [(g.tokens, g.log_probs) for g in engine.generate(prompts(3), _params(top_k))]


CASES = [  # (checkpoint, its one-process checkpoint, tp, pp, top_k)
    ("gpt", "gpt", 2, 1, 1), ("gpt", "gpt", 1, 2, 4), ("gpt", "gpt", 2, 2, 1), ("gpt_dist", "gpt", 2, 1, 4),
    ("rope_gqa_tp2pp2", "rope_gqa", 2, 2, 4), ("moe", "moe", 1, 2, 1),
    ("moe", "moe", 2, 1, 4), ("moe", "moe", 2, 2, 1),  # MoE at TP2: each TP rank routes its share of the tokens
    ("mla_mtp", "mla_mtp", 2, 1, 4), ("mla_mtp", "mla_mtp", 2, 2, 1),  # MLA's heads over TP; MTP on the last stage
]


@pytest.mark.parametrize("name, single, tp, pp, top_k", CASES, ids=[f"{c[0]}-tp{c[2]}pp{c[3]}-k{c[4]}" for c in CASES])
def test_parallel_generation_equals_one_process(name, single, tp, pp, top_k, checkpoints):
    model, _ = load_model(checkpoints[single])
    engine = InferenceEngine(model, vocab_size=VOCAB, max_sequence_length=MAX_LEN, eod=VOCAB - 1)
    want = engine.generate(prompts(3), _params(top_k))
    per_rank = run_ranks(tp * pp, generate_on_ranks, checkpoints[name], tp, pp, top_k)
    for rank, got in enumerate(per_rank):
        for (tokens, log_probs), ref in zip(got, want):
            assert tokens == ref.tokens, f"rank {rank}"
            assert_close(torch.tensor(log_probs), torch.tensor(ref.log_probs), what=f"rank {rank}")


def _nan_then_healthy(root, tp, pp):
    """Every rank: a generation whose last stage's logits are NaN, then a healthy one."""
    from megatron_lite.inference.sampling import NonFiniteLogitsError

    state = cached_state(tp=tp, pp=pp)
    model, _ = load_model(root, state)
    engine = InferenceEngine(model, state, vocab_size=VOCAB, max_sequence_length=MAX_LEN, eod=VOCAB - 1)
    healthy = engine.forward
    engine.forward = lambda *a, **k: None if (out := healthy(*a, **k)) is None else out.fill_(float("nan"))
    try:
        engine.generate(prompts(2), _params(4))
        raised = None
    except NonFiniteLogitsError as err:
        raised = str(err)
    engine.forward = healthy
    return raised, [g.tokens for g in engine.generate(prompts(2), _params(4))]


def test_nan_logits_raise_on_every_rank_together_and_the_ranks_stay_in_step(checkpoints):
    """Only the last stage samples: NaN logits there used to raise on it alone (torch.multinomial)
    while the other ranks waited in the token broadcast. Now every rank raises the same error
    and the next generation still works."""
    model, _ = load_model(checkpoints["gpt"])
    want = InferenceEngine(model, vocab_size=VOCAB, max_sequence_length=MAX_LEN, eod=VOCAB - 1).generate(
        prompts(2), _params(4))
    for rank, (raised, tokens) in enumerate(run_ranks(2, _nan_then_healthy, checkpoints["gpt"], 1, 2)):
        assert raised is not None and raised.startswith("the model's logits hold NaN or inf"), f"rank {rank}"
        assert tokens == [g.tokens for g in want], f"rank {rank}"


PENALIZED = dict(tokens_to_generate=NEW, top_k=4, random_seed=5, stop_on_eod=False, frequency_penalty=1.0,
                 presence_penalty=0.5, logit_bias=((3, 4.0), (60, -100.0), (VOCAB - 2, 1.5)))


def penalized_on_ranks(root, tp, pp):
    state = cached_state(tp=tp, pp=pp)
    model, _ = load_model(root, state)
    engine = InferenceEngine(model, state, vocab_size=VOCAB, max_sequence_length=MAX_LEN, eod=VOCAB - 1)
    return [g.tokens for g in engine.generate(prompts(3), SamplingParams(**PENALIZED))]


def test_penalties_and_logit_bias_at_tp2_pp2_equal_one_process(checkpoints):
    """The sampling rank (last stage, TP rank 0: rank 2 of 4, not the serving rank 0) counts the
    generated tokens and biases ids across the whole vocabulary, whose halves two TP ranks compute."""
    model, _ = load_model(checkpoints["gpt"])
    engine = InferenceEngine(model, vocab_size=VOCAB, max_sequence_length=MAX_LEN, eod=VOCAB - 1)
    want = [g.tokens for g in engine.generate(prompts(3), SamplingParams(**PENALIZED))]
    plain = [g.tokens for g in engine.generate(prompts(3), _params(4))]
    assert want != plain  # the penalties change the sample
    for rank, got in enumerate(run_ranks(4, penalized_on_ranks, checkpoints["gpt"], 2, 2)):
        assert got == want, f"rank {rank}"


BEAM = SamplingParams(tokens_to_generate=10, beam_width=4, length_penalty=0.7, stop_token_ids=(3,))


def beams_on_ranks(root, tp, pp):
    state = cached_state(tp=tp, pp=pp)
    model, _ = load_model(root, state)
    engine = InferenceEngine(model, state, vocab_size=VOCAB, max_sequence_length=MAX_LEN, eod=VOCAB - 1)
    return [(g.tokens, g.score) for g in engine.generate(prompts(1), BEAM)]


def test_beam_search_at_tp2_pp2_equals_one_process(checkpoints):
    """MLA's compressed cache split over TP ranks and PP stages: every rank reorders its own rows by
    the beam origins the sampling rank (rank 2) ranks, so every rank returns the one-process beams."""
    model, _ = load_model(checkpoints["mla_mtp"])
    want = InferenceEngine(model, vocab_size=VOCAB, max_sequence_length=MAX_LEN, eod=VOCAB - 1).generate(
        prompts(1), BEAM)
    assert len({tuple(w.tokens) for w in want}) == 4
    for rank, got in enumerate(run_ranks(4, beams_on_ranks, checkpoints["mla_mtp"], 2, 2)):
        assert [t for t, _ in got] == [w.tokens for w in want], f"rank {rank}"
        assert_close(torch.tensor([s for _, s in got]), torch.tensor([w.score for w in want]), what=f"rank {rank}")


def stream_log_probs_on_ranks(root, tp, pp):
    """Every rank's joined per-step log-probs (``step_log_probs``) and its final ones."""
    state = cached_state(tp=tp, pp=pp)
    model, _ = load_model(root, state)
    engine = InferenceEngine(model, state, vocab_size=VOCAB, max_sequence_length=MAX_LEN, eod=VOCAB - 1)
    params = SamplingParams(tokens_to_generate=6, top_k=4, random_seed=5, top_n_logprobs=2, step_log_probs=True)
    steps, joined = engine.stream(prompts(3), params), [[] for _ in range(3)]
    while True:
        try:
            step = next(steps)
        except StopIteration as end:
            return joined, [(g.log_probs, g.top_log_probs) for g in end.value]
        for i in range(3):
            joined[i] += list(zip(step.log_probs[i], step.top_log_probs[i]))


def test_each_steps_log_probs_reach_every_rank_at_tp2_pp2(checkpoints):
    """Streamed log-probs: the last stage's TP rank 0 broadcasts each step's with its tokens, so every
    rank (the first stage's too, which computes none) hands out the final log-probs as they come."""
    for rank, (joined, final) in enumerate(run_ranks(4, stream_log_probs_on_ranks, checkpoints["gpt"], 2, 2)):
        for got, (log_probs, tops) in zip(joined, final):
            assert got[:len(log_probs)] == list(zip(log_probs, tops)) and any(v != 0 for v in log_probs), f"rank {rank}"


SPLIT_VOCAB = 628  # rows over a ~600-id tokenizer: padded to 632 in one process, to 640 (2 x 320) at TP2,
# so the ids the tokenizer lacks and the padded rows all lie in TP rank 1's half of the vocabulary


@pytest.fixture(scope="module")
def small_tokenizer_checkpoint(tmp_path_factory):
    """A ``gpt`` checkpoint of SPLIT_VOCAB ids with a smaller GPT-2 BPE tokenizer, whose model prefers
    the ids past the tokenizer's; (root, the tokenizer's size)."""
    from megatron_lite.data.tokenizers import build_tokenizer
    from tests.inference_helpers import prefer_ids_from
    from tests.preprocess_helpers import make_tok_files

    fields = {"tokenizer_type": "GPT2BPETokenizer", **make_tok_files(tmp_path_factory)["GPT2BPETokenizer"]}
    size = build_tokenizer(**fields).vocab_size
    assert size < SPLIT_VOCAB
    root = str(tmp_path_factory.mktemp("small_tokenizer") / "ckpt")
    save_model("gpt", root, tokenizer=fields, vocab=SPLIT_VOCAB, adjust=lambda m: prefer_ids_from(m, size))
    return root, size


UNPRINTABLE_RUNS = [SamplingParams(tokens_to_generate=10, top_k=1, top_n_logprobs=3, stop_on_eod=False),
                    SamplingParams(tokens_to_generate=10, top_k=0, random_seed=5, top_n_logprobs=3, stop_on_eod=False)]


def generate_with_tokenizer(root, tp, with_tokenizer=True):
    """Greedy and full-vocabulary sampled generations (tokens, log-probs, top log-probs) at TP ``tp``,
    with the engine told the tokenizer (its unprintable ids masked) or not."""
    from megatron_lite.inference.loading import load_tokenizer

    state = cached_state(tp=tp) if tp > 1 else None
    model, saved = load_model(root, state)
    tokenizer = load_tokenizer(saved)
    engine = InferenceEngine(model, state, vocab_size=SPLIT_VOCAB, max_sequence_length=MAX_LEN, eod=tokenizer.eod,
                             tokenizer=tokenizer if with_tokenizer else None)
    prompt = [tokenizer.tokenize("The quick brown fox"), tokenizer.tokenize("a b")]
    return [[(g.tokens, g.log_probs, g.top_log_probs) for g in engine.generate(prompt, params)]
            for params in UNPRINTABLE_RUNS]


def test_unprintable_ids_are_never_chosen_at_tp2_with_a_split_padded_vocabulary(small_tokenizer_checkpoint):
    """The ids past the tokenizer's (and the padding) sit in TP rank 1's vocabulary shard; the
    sampling rank (TP rank 0) masks them in the gathered logits: greedy, full-vocabulary sampling and
    the top log-probs never name one (the blind engine, without the tokenizer, picks them), and every
    rank returns the one-process tokens and log-probs (1e-5)."""
    root, size = small_tokenizer_checkpoint
    want = generate_with_tokenizer(root, 1)
    blind = run_ranks(2, generate_with_tokenizer, root, 2, False)[0]
    assert all(t >= size for run in blind for tokens, _, _ in run for t in tokens[-10:])  # the model prefers them
    for rank, got in enumerate(run_ranks(2, generate_with_tokenizer, root, 2)):
        for run, ref in zip(got, want):
            for (tokens, log_probs, tops), (ref_tokens, ref_log_probs, ref_tops) in zip(run, ref):
                assert tokens == ref_tokens and all(t < size for t in tokens), f"rank {rank}"
                assert all(t < size for position in tops for t, _ in position), f"rank {rank}"
                assert [[t for t, _ in p] for p in tops] == [[t for t, _ in p] for p in ref_tops], f"rank {rank}"
                assert_close(torch.tensor(log_probs), torch.tensor(ref_log_probs), what=f"rank {rank}")
