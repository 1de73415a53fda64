"""Speculative decoding with the model's multi-token prediction heads (megatron_lite/inference/speculative.py).

- Greedy: the tokens (and log-probs, within 1e-5 of the largest logit) of plain greedy decoding, for a
  GPT with 3 MTP depths (rotary, GQA) and for MLA + 2 MTP depths, at every number of drafts.
- With drafts forced to the right token or a wrong one in a fixed pattern (so rounds keep none, some or
  all of them, and the main cache - MLA's compressed latent included - is truncated after each), the
  output is still plain greedy decoding's, and every depth's logits at every round equal those of one
  uncached forward pass of the training path over the same tokens: each depth's own key/value cache
  holds what its attention saw in training.
- Sampling: :func:`speculative_accept` emits tokens distributed as the target ``p`` (Pearson's chi-square
  at p = 1e-6 over 4000 rounds with a fixed seed, as tests/unit/test_sampling_distribution.py does, with a
  check that a wrong rule would be rejected), and the engine hands it the main model's sampling
  distribution at each draft (that of one forward pass over the same tokens).
- A stop token among a step's kept drafts ends the text there, as without drafts.
- What is not supported is refused in one line.
"""

import re
from types import SimpleNamespace

import pytest
import torch

from megatron_lite.inference.engine import InferenceEngine
from megatron_lite.inference.sampling import SamplingParams, sampling_logits
from megatron_lite.inference.speculative import (
    MTPDrafter,
    SpeculativeEngine,
    check_speculative_model,
    speculative_accept,
)
from tests.inference_helpers import MAX_LEN, VOCAB, assert_close, build_model, mtp_model, prompts

NEW = 24
CRITICAL = {5: 35.89, 6: 38.26, 7: 40.52}  # chi-square at p = 1e-6 by degrees of freedom


MODELS = {"gpt_mtp3": ("rope_gqa", 3), "mla_mtp2": ("mla_mtp", 2)}


@pytest.fixture(scope="module")
def models():
    return {name: mtp_model(*spec) for name, spec in MODELS.items()}


def engines(model, num_tokens):
    kw = dict(vocab_size=VOCAB, max_sequence_length=MAX_LEN, eod=VOCAB - 1)
    return InferenceEngine(model, **kw), SpeculativeEngine(model, num_speculative_tokens=num_tokens, **kw)


GREEDY = SamplingParams(tokens_to_generate=NEW, top_k=1, stop_on_eod=False, top_n_logprobs=2)


@pytest.mark.parametrize("name, num_tokens", [("gpt_mtp3", 1), ("gpt_mtp3", 3), ("mla_mtp2", 2)])
def test_greedy_with_drafts_is_greedy_token_for_token(models, name, num_tokens):
    plain, spec = engines(models[name], num_tokens)
    for prompt in prompts(2, seed=3, lengths=(6, 11)):
        want, got = plain.generate([prompt], GREEDY)[0], spec.generate([prompt], GREEDY)[0]
        assert got.tokens == want.tokens and got.finish_reason == want.finish_reason
        assert_close(torch.tensor(got.log_probs), torch.tensor(want.log_probs))
        assert [[t for t, _ in row] for row in got.top_log_probs] == [[t for t, _ in row] for row in want.top_log_probs]
    t = spec.timings
    assert t["tokens"] == NEW - 1 and t["drafted"] >= t["verify_steps"] - num_tokens  # every step drafted


def full_mtp_logits(model, tokens: list[int], n: int, depth: int) -> torch.Tensor:
    """Depth ``depth``'s logits ``[V]`` at position ``n - 1`` by the training path, uncached: the
    decoder over ``tokens[:n]``, depth ``k`` reading ``tokens[i + k]`` at position ``i``."""
    with torch.no_grad():
        ids = torch.tensor([tokens[:n]])
        x = model._input_hidden(ids)
        rotary = model._rotary(x)
        h = model.decoder(x, None, rotary)
        for k in range(1, depth + 1):
            h = model.mtp.layers[k - 1](h, model._embed_for_mtp(torch.tensor([tokens[k:n + k]])), None, rotary, True)
        return model._logits(h)[-1, 0, :VOCAB]


@pytest.mark.parametrize("name", list(MODELS))
def test_forced_drafts_roll_back_the_caches_and_each_depth_sees_its_training_context(models, name, monkeypatch):
    model = models[name]
    depths = len(model.mtp.layers)
    plain, spec = engines(model, depths)
    prompt = prompts(1, seed=4, lengths=(7,))[0]
    want = plain.generate([prompt], GREEDY)[0].tokens
    checked = []

    def pick(self, logits, depth, context):
        n = len(context) - depth  # the round's position: context is t(0..n) and the depth - 1 drafts before
        assert_close(logits[0], full_mtp_logits(model, context, n, depth), what=f"depth {depth} at {n}")
        checked.append(depth)
        right = want[n + depth]
        return (right if (n + 2 * depth) % 5 else (right + 1) % (VOCAB - 1)), None  # a wrong one now and then

    monkeypatch.setattr(MTPDrafter, "pick", pick)
    got = spec.generate([prompt], GREEDY)[0]
    assert got.tokens == want
    t = spec.timings
    assert 0 < t["accepted"] < t["drafted"] and t["tokens"] / t["verify_steps"] > 1.5, t
    assert set(checked) == set(range(1, depths + 1))


@pytest.mark.parametrize("name", list(MODELS))
def test_a_batch_of_prompts_is_greedy_token_for_token_each_sequence_keeping_its_own_drafts(models, name, monkeypatch):
    """Four prompts of different lengths in one batch, drafts forced right or wrong in a pattern that
    differs per sequence (so each keeps its own number per verify step and the caches, MLA's latent
    included, are cut back to different lengths), one sequence ending early at a stop token: each is
    plain greedy decoding of its prompt alone, tokens and log-probs."""
    model = models[name]
    depths = len(model.mtp.layers)
    batch = prompts(4, seed=6, lengths=(3, 10, 1, 7))
    free = [engines(model, depths)[0].generate([p], GREEDY)[0].tokens for p in batch]
    stop = free[1][len(batch[1]) + 5]  # sequence 1 stops at its 6th new token (or at an earlier occurrence)
    kw = dict(vocab_size=VOCAB, max_sequence_length=MAX_LEN, eod=stop)
    params = SamplingParams(tokens_to_generate=NEW, top_k=1, top_n_logprobs=2)
    plain, spec = InferenceEngine(model, **kw), SpeculativeEngine(model, num_speculative_tokens=depths, **kw)
    want = [plain.generate([p], params)[0] for p in batch]

    def pick(self, logits, depth, context):
        i = next(i for i, w in enumerate(want) if w.tokens[:len(context) - depth + 1] == context[:len(context) - depth + 1])
        right = free[i][len(context)] if len(context) < len(free[i]) else 0
        return (right if (len(context) * (i + 2)) % 5 else (right + 1) % (VOCAB - 1)), None

    monkeypatch.setattr(MTPDrafter, "pick", pick)
    got = spec.generate(batch, params)
    for g, w in zip(got, want):
        assert (g.tokens, g.finish_reason) == (w.tokens, w.finish_reason)
        assert_close(torch.tensor(g.log_probs), torch.tensor(w.log_probs))
    assert [g.finish_reason for g in got].count("stop") >= 1 and len(got[1].generated) < NEW
    t = spec.timings
    assert 0 < t["accepted"] < t["drafted"] and t["tokens"] > t["verify_steps"], t


def test_a_stop_token_among_kept_drafts_ends_the_text_there(models, monkeypatch):
    model = models["gpt_mtp3"]
    prompt = prompts(1, seed=4, lengths=(7,))[0]
    free = engines(model, 3)[0].generate([prompt], GREEDY)[0].tokens
    stop = free[len(prompt) + 6]  # the 7th new token (an earlier occurrence stops first, in both engines)
    kw = dict(vocab_size=VOCAB, max_sequence_length=MAX_LEN, eod=stop)
    params = SamplingParams(tokens_to_generate=NEW, top_k=1)
    want = InferenceEngine(model, **kw).generate([prompt], params)[0]
    monkeypatch.setattr(MTPDrafter, "pick", lambda self, logits, depth, context: (free[len(context)], None))
    spec = SpeculativeEngine(model, num_speculative_tokens=3, **kw)
    got = spec.generate([prompt], params)[0]
    assert (got.tokens, got.finish_reason) == (want.tokens, "stop") and len(got.generated) < NEW
    assert spec.timings["accepted"] > 0


def _draws(p, q, count, seed=7):
    """First and second emitted tokens of ``count`` rounds of two drafts drawn from ``q``, target ``p``."""
    g = torch.Generator().manual_seed(seed)
    first, second = [], []
    drawn = torch.stack([torch.multinomial(q[i], count, replacement=True, generator=g) for i in range(2)], 1).tolist()
    for drafts in drawn:
        kept, token = speculative_accept(p, q, drafts, g)
        out = drafts[:kept] + [token]
        first.append(out[0])
        if len(out) > 1:
            second.append(out[1])
    return torch.bincount(torch.tensor(first), minlength=8), torch.bincount(torch.tensor(second), minlength=8)


def _chi_square(counts, probs):
    total = int(counts.sum())
    cells = [(int(c), total * float(p)) for c, p in zip(counts, probs) if p > 0]
    assert all(c == 0 for c, p in zip(counts.tolist(), probs.tolist()) if p == 0)
    return sum((c - e) ** 2 / e for c, e in cells), len(cells) - 1


def test_speculative_sampling_draws_from_the_target_distribution():
    g = torch.Generator().manual_seed(0)
    p = torch.randn(3, 8, generator=g).mul(1.5).softmax(-1).double()
    p[1, 5] = 0.0  # a token the target never takes (top-k / top-p filtered) but the draft may
    p[1] /= p[1].sum()
    q = torch.randn(2, 8, generator=g).mul(1.5).softmax(-1).double()
    q[0, 2] = 0.0  # and one the draft never proposes
    q[0] /= q[0].sum()
    first, second = _draws(p, q, 4_000)
    for counts, target, draft in ((first, p[0], q[0]), (second, p[1], q[1])):
        stat, df = _chi_square(counts, target)
        assert stat < CRITICAL[df], (stat, df, counts)
        wrong = 0.5 * (target + draft)  # a rule keeping too many drafts drifts towards q
        assert _chi_square(counts, wrong)[0] > 5 * CRITICAL[df]


def test_sampling_compares_the_drafts_with_the_main_models_sampling_distribution(models, monkeypatch):
    model = models["gpt_mtp3"]
    _, spec = engines(model, 2)
    params = SamplingParams(tokens_to_generate=16, temperature=1.5, top_k=5, stop_on_eod=False, random_seed=3)
    seen = []

    def accept(p, q, drafts, generator):
        kept, token = speculative_accept(p, q, drafts, generator)
        seen.append((p, q, list(drafts), kept))
        return kept, token

    monkeypatch.setattr("megatron_lite.inference.speculative.speculative_accept", accept)
    batch = prompts(2, lengths=(5, 8))  # a batch: each sequence's rounds, in turn
    results = spec.generate(batch, params)
    wants, positions = [], [len(p) - 1 for p in batch]  # the prefill's last row, then each verify step's rows
    for g in results:
        with torch.no_grad():
            logits = model(torch.tensor([g.tokens]))[0, :, :VOCAB].float()
        wants.append(sampling_logits(logits, params).softmax(-1))  # what plain sampling draws each token from
    for p, q, drafts, kept in seen:
        i = next(i for i, w in enumerate(wants) if positions[i] + kept + 1 <= len(w)
                 and torch.allclose(p[:kept + 1], w[positions[i]:positions[i] + kept + 1], rtol=1e-4, atol=1e-6))
        if drafts:  # the drafts' distributions: normalised, top-k filtered like the target's
            assert q.shape[0] == len(drafts) and torch.allclose(q.sum(-1), torch.ones(len(drafts)))
            assert all(int((row > 0).sum()) <= 5 for row in q)
        positions[i] += kept + 1
    assert positions == [len(g.tokens) - 1 for g in results] and sum(len(d) for _, _, d, _ in seen) > 8


def test_unsupported_requests_and_models_are_refused_in_one_line(models):
    model = models["mla_mtp2"]
    kw = dict(vocab_size=VOCAB, max_sequence_length=MAX_LEN, eod=VOCAB - 1)
    with pytest.raises(ValueError, match="has 2 multi-token prediction head.*pass at most 2"):
        SpeculativeEngine(model, num_speculative_tokens=3, **kw)
    with pytest.raises(ValueError, match="no multi-token prediction heads"):
        SpeculativeEngine(build_model("rope_gqa"), num_speculative_tokens=1, **kw)
    with pytest.raises(ValueError, match="needs the key/value cache"):
        SpeculativeEngine(model, num_speculative_tokens=1, use_cache=False, **kw)
    for stage in (model, build_model("rope_gqa")):  # PP2: the last stage holds the MTP heads, the first none
        with pytest.raises(ValueError, match="tensor parallelism only.*--pipeline-model-parallel-size 1 and "
                                             "--tensor-model-parallel-size 2"):
            check_speculative_model(stage, SimpleNamespace(world_size=2, tp_size=1), 1)
    check_speculative_model(model, SimpleNamespace(world_size=2, tp_size=2), 1)  # TP2: tests/e2e/specdec_ranks.py
    spec = SpeculativeEngine(model, num_speculative_tokens=1, **kw)
    two = prompts(2)
    for call, words in [(lambda: spec.generate(two[:1], SamplingParams(beam_width=2)), "beam search"),
                        (lambda: spec.generate(two[:1], SamplingParams(presence_penalty=0.5)), "presence_penalty"),
                        (lambda: spec.generate(two[:1], SamplingParams(logit_bias=((1, 2.0),))), "logit_bias"),
                        (lambda: spec.generate(two[:1], SamplingParams(stop_strings=("a",))), "stop strings")]:
        with pytest.raises(ValueError, match=words):
            call()


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    from tests.inference_helpers import save_model

    root = tmp_path_factory.mktemp("specdec")
    save_model("mla_mtp", str(root / "mla_mtp"))  # one MTP depth
    save_model("rope_gqa", str(root / "plain"))
    return str(root)


def test_generate_tool_speculates_greedily_and_prints_the_acceptance(mtp_checkpoint, capsys):
    from tests.tools import load_tool

    gen = load_tool("generate")
    argv = ["--load", f"{mtp_checkpoint}/mla_mtp", "--prompt", "5 17 3 40", "--max-new-tokens", "12", "--greedy"]
    assert gen.main(argv) == 0
    plain = capsys.readouterr()
    assert gen.main(argv + ["--num-speculative-tokens", "1"]) == 0
    spec = capsys.readouterr()
    assert spec.out == plain.out and len(plain.out.split()) == 16
    assert spec.err.startswith("speculative decoding (1 token(s) per draft): ") and "tokens per verify step" in spec.err


def _printed(out: str):
    """(texts, [(token, log-prob)]) of generate.py's output with --log-probs."""
    rows = [line.split() for line in out.splitlines() if line.startswith("  ")]
    return [line for line in out.splitlines() if line and not line.startswith("  ")], [(int(r[0]), float(r[1])) for r in rows]


def test_generate_tool_speculates_several_prompts_in_one_batch(mtp_checkpoint, capsys, monkeypatch):
    """Three prompts of different lengths: the plain batch's greedy text and log-probs (printed with 4
    decimals), from one speculative batch, the acceptance summed over the three."""
    from megatron_lite.inference.speculative import SpeculativeEngine
    from tests.tools import load_tool

    gen = load_tool("generate")
    argv = ["--load", f"{mtp_checkpoint}/mla_mtp", "--max-new-tokens", "10", "--greedy", "--log-probs"]
    for prompt in ("5 17 3 40", "8", "1 2 3 4 5 6 7"):
        argv += ["--prompt", prompt]
    assert gen.main(argv) == 0
    plain = capsys.readouterr().out
    calls = []
    generate = SpeculativeEngine.generate
    monkeypatch.setattr(SpeculativeEngine, "generate", lambda self, p, params: calls.append(p) or generate(self, p, params))
    assert gen.main(argv + ["--num-speculative-tokens", "1"]) == 0
    spec = capsys.readouterr()
    text, scored = _printed(spec.out), _printed(plain)
    assert text[0] == scored[0] and [t for t, _ in text[1]] == [t for t, _ in scored[1]] and len(calls) == 1
    assert all(abs(a - b) <= 2e-4 for (_, a), (_, b) in zip(text[1], scored[1])) and len(calls[0]) == 3
    found = re.search(r"over (\d+) verify step\(s\), (\d+) of", spec.err)  # the three prompts' totals
    steps, accepted = int(found[1]), int(found[2])
    assert steps + accepted == 3 * 9, spec.err  # 10 new tokens each: the prefill's, then 9 from verify steps


@pytest.mark.parametrize("load, flags, words", [
    ("mla_mtp", ["--num-speculative-tokens", "2"], "has 1 multi-token prediction head(s) (--mtp-num-layers 1); pass at most 1"),
    ("plain", ["--num-speculative-tokens", "1"], "no multi-token prediction heads"),
    ("mla_mtp", ["--num-speculative-tokens", "1", "--no-kv-cache"], "leave out --no-kv-cache"),
    ("mla_mtp", ["--num-speculative-tokens", "0"], "must be at least 1"),
])
def test_generate_tool_refuses_what_cannot_speculate_in_one_line(mtp_checkpoint, capsys, load, flags, words):
    from tests.cli_errors import refused_line
    from tests.tools import load_tool

    gen = load_tool("generate")
    argv = ["--load", f"{mtp_checkpoint}/{load}", "--prompt", "1 2 3", *flags]

    def call():
        raise SystemExit(gen.main(argv))

    refused_line(capsys, call, "--num-speculative-tokens", words)


def test_the_benchmark_runs_and_finds_greedy_unchanged(capsys):
    from benchmarks import bench_specdec

    argv = ["--steps", "2", "--layers", "1", "--hidden", "32", "--vocab", "64", "--new", "6", "--rounds", "1",
            "--prompts", "1", "--batch", "2", "--threads", "1"]
    assert bench_specdec.main(argv) == 0
    out = capsys.readouterr().out
    assert "N=2, greedy" in out and "N=2, T=1" in out and "token for token: True (batch of 2: True)" in out
