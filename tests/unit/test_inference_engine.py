"""The inference engine in one process: the key/value cache reproduces a full recompute, batching
prompts of different lengths changes nothing, sampling follows Megatron's rules, stops and
log-probs are right, and MoE layers drop no token at inference.

Tolerances: fp32, logits and log-probs within 1e-5 relative to the largest logit (|logits| <= ~8
here; the cache changes only the order of the sums inside attention)."""

import re

import pytest
import torch

from megatron_lite.inference.engine import InferenceEngine
from megatron_lite.inference.kv_cache import KVCache
from megatron_lite.inference.loading import load_model
from megatron_lite.inference.sampling import (
    NonFiniteLogitsError,
    SamplingParams,
    filter_top_k,
    filter_top_p,
    sample,
)
from tests.inference_helpers import (
    MAX_LEN,
    VARIANTS,
    VOCAB,
    assert_close,
    build_model,
    prefer_ids_from,
    prompts,
    save_model,
)

NEW = 64


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("inference")
    for variant in VARIANTS:
        save_model(variant, str(root / variant))
    return {v: str(root / v) for v in VARIANTS}


def engine_for(root, **kw):
    model, saved = load_model(root)
    return InferenceEngine(model, vocab_size=VOCAB, max_sequence_length=MAX_LEN, eod=VOCAB - 1, **kw)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cached_decoding_equals_full_recompute_at_every_step(variant, checkpoints):
    model, _ = load_model(checkpoints[variant])
    tokens = torch.tensor(prompts(2, lengths=(8,)))
    cache = KVCache(2, 8 + NEW)
    with torch.no_grad():
        logits = model(tokens, inference_context=cache)
        cache.advance(8)
        assert_close(logits, model(tokens))
        for step in range(NEW):
            new = logits[:, -1, :VOCAB].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, new], dim=1)
            logits = model(new, inference_context=cache)
            cache.advance(1)
            full = model(tokens)[:, -1:]
            assert_close(logits, full, what=f"step {step}")
    assert cache.sequence_offset == 8 + NEW


@pytest.mark.parametrize("variant, top_k", [("gpt", 1), ("rope_gqa", 5), ("moe", 0), ("mla_mtp", 5)])
def test_engine_with_cache_equals_engine_without(variant, top_k, checkpoints):
    batch = prompts(3)
    params = SamplingParams(tokens_to_generate=NEW, top_k=top_k, random_seed=7, stop_on_eod=False)
    cached = engine_for(checkpoints[variant]).generate(batch, params)
    full = engine_for(checkpoints[variant], use_cache=False).generate(batch, params)
    model, _ = load_model(checkpoints[variant])
    for c, f, prompt in zip(cached, full, batch):
        assert c.tokens == f.tokens and c.tokens[:len(prompt)] == prompt and len(c.generated) == NEW
        assert_close(torch.tensor(c.log_probs), torch.tensor(f.log_probs))
        # independently: the log-softmax of one forward pass over the whole sequence
        with torch.no_grad():
            logp = model(torch.tensor([c.tokens]))[0, :-1, :VOCAB].log_softmax(-1)
        want = logp.gather(-1, torch.tensor(c.tokens[1:]).unsqueeze(-1)).squeeze(-1)
        assert_close(torch.tensor(c.log_probs), want)


def test_a_batch_of_different_lengths_equals_each_prompt_alone(checkpoints):
    engine = engine_for(checkpoints["rope_gqa"])
    batch = prompts(3, lengths=(3, 11, 6))
    params = SamplingParams(tokens_to_generate=12, top_k=1, stop_on_eod=False)
    together = engine.generate(batch, params)
    for prompt, got in zip(batch, together):
        alone = engine.generate([prompt], params)[0]
        assert got.tokens == alone.tokens and got.prompt_length == len(prompt)
        assert_close(torch.tensor(got.log_probs), torch.tensor(alone.log_probs))


def test_generation_stops_at_the_end_of_document_or_a_stop_token(checkpoints):
    engine = engine_for(checkpoints["gpt"])
    batch = prompts(2)
    free = engine.generate(batch, SamplingParams(tokens_to_generate=20, top_k=1, stop_on_eod=False))
    stop = free[0].generated[4]
    first = free[0].generated.index(stop)
    by_token = engine.generate(batch, SamplingParams(tokens_to_generate=20, top_k=1, stop_on_eod=False,
                                                     stop_token_ids=(stop,)))
    engine.eod = stop
    by_eod = engine.generate(batch, SamplingParams(tokens_to_generate=20, top_k=1))
    for got in (by_token, by_eod):
        assert got[0].generated == free[0].generated[:first + 1] and got[0].finish_reason == "stop"
        assert len(got[0].log_probs) == len(got[0].tokens) - 1
        want = free[1].generated[:free[1].generated.index(stop) + 1] if stop in free[1].generated else free[1].generated
        assert got[1].generated == want
    assert free[0].finish_reason == "length"


def test_seeded_sampling_is_reproducible_and_the_seed_matters(checkpoints):
    engine = engine_for(checkpoints["gpt"])
    params = lambda seed: SamplingParams(tokens_to_generate=16, top_p=0.9, temperature=1.5, random_seed=seed)  # noqa: E731
    a, b, c = (engine.generate(prompts(2), params(s)) for s in (3, 3, 4))
    assert [g.tokens for g in a] == [g.tokens for g in b]
    assert [g.tokens for g in a] != [g.tokens for g in c]


def test_moe_layers_drop_no_token_at_inference(checkpoints):
    """The checkpoint was trained with --moe-expert-capacity-factor 1.0; generating uses no capacity."""
    engine = engine_for(checkpoints["moe"])
    tokens = torch.tensor(prompts(2, lengths=(24,)))
    with_capacity = build_model("moe")  # the same weights, the saved capacity factor
    without = build_model("moe")
    for module in without.modules():
        if hasattr(module, "config") and hasattr(module.config, "moe_expert_capacity_factor"):
            module.config.moe_expert_capacity_factor = None
    with torch.no_grad():
        got, dropping, full = engine.forward(tokens), with_capacity(tokens)[..., :VOCAB], without(tokens)[..., :VOCAB]
    assert_close(got, full)
    assert not torch.allclose(dropping, full, atol=1e-3)  # the capacity would have dropped tokens


def test_sampling_rules():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5], [0.0, -1.0, 4.0, 3.9]])
    assert sample(logits, SamplingParams(top_k=1, temperature=50.0), None).tolist() == [1, 2]  # greedy ignores T
    kept = filter_top_k(logits, 2)
    assert torch.isfinite(kept).tolist() == [[False, True, True, False], [False, False, True, True]]
    probs = logits.softmax(-1)  # best tokens: 0.63 in row 0, 0.52 (then 0.47) in row 1
    assert torch.isfinite(filter_top_p(logits, 0.6)).sum(-1).tolist() == [1, 2]
    assert torch.isfinite(filter_top_p(logits, float(probs[0].max()) + 0.01)).sum(-1).tolist()[0] == 2
    gen = torch.Generator().manual_seed(0)
    draws = torch.stack([sample(logits, SamplingParams(top_k=2), gen) for _ in range(200)])
    assert set(draws[:, 0].tolist()) == {1, 2} and set(draws[:, 1].tolist()) == {2, 3}


@pytest.mark.parametrize("top_k, top_p", [(0, 0.0), (3, 0.0), (0, 0.9)])
def test_a_temperature_small_enough_to_overflow_is_greedy(top_k, top_p):
    logits = torch.tensor([[10.0, 30.0, 20.0, -5.0], [0.0, -10.0, 40.0, 39.0]])  # / 1e-38 overflows fp32
    gen = torch.Generator().manual_seed(0)
    for temperature in (1e-38, 1e-45, 1e-30):
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        params.check()
        assert [sample(logits, params, gen).tolist() for _ in range(20)] == [[1, 2]] * 20


@pytest.mark.parametrize("top_k", [0, 1, 4])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_logits_holding_nan_or_inf_are_one_clear_error(top_k, bad):
    logits = torch.zeros(2, 6)
    logits[1, 3] = bad
    with pytest.raises(NonFiniteLogitsError, match="^the model's logits hold NaN or inf"):
        sample(logits, SamplingParams(top_k=top_k), None)


def test_generation_over_nan_logits_is_one_clear_error(checkpoints):
    engine = engine_for(checkpoints["gpt"])
    healthy = engine.forward
    engine.forward = lambda *a, **k: healthy(*a, **k).fill_(float("nan"))
    with pytest.raises(NonFiniteLogitsError):
        engine.generate(prompts(2), SamplingParams(tokens_to_generate=4, random_seed=1))
    engine.forward = healthy
    assert len(engine.generate(prompts(2), SamplingParams(tokens_to_generate=4))[0].generated) == 4


@pytest.mark.parametrize("field, value, message", [
    ("tokens_to_generate", -1, "tokens_to_generate must be an integer >= 0"),
    ("temperature", 0.0, "temperature must be in (0, 100]"),
    ("top_k", 1001, "top_k must be an integer in [0, 1000]"),
    ("top_p", 1.5, "top_p must be in [0, 1]"),
    ("random_seed", -3, "random_seed must be an integer in [0, 2^64)"),
    ("random_seed", 2**64, "random_seed must be an integer in [0, 2^64)"),
])
def test_bad_sampling_params_name_the_field(field, value, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        SamplingParams(**{field: value}).check()
    with pytest.raises(ValueError, match="cannot set both top_k and top_p"):
        SamplingParams(top_k=2, top_p=0.5).check()


def test_more_top_log_probs_than_tokens_is_refused_before_any_step(checkpoints):
    """A vocabulary under 20 tokens: more top log-probs than tokens only failed on the last pipeline
    stage (the other ranks waited); now every rank refuses it first, in the engine and the batch."""
    from megatron_lite.inference.scheduler import Scheduler

    engine = engine_for(checkpoints["gpt"])
    engine.vocab_size = 8
    params = SamplingParams(tokens_to_generate=2, top_n_logprobs=9)
    with pytest.raises(ValueError, match="^top_n_logprobs 9 is more than the vocabulary's 8 tokens"):
        engine.generate([[1, 2]], params)
    with pytest.raises(ValueError, match="^top_n_logprobs 9 is more than the vocabulary's 8 tokens"):
        Scheduler(engine, 2).add([[1, 2]], params)
    with pytest.raises(ValueError, match="^logit_bias: a token id is outside the vocabulary"):
        Scheduler(engine, 2).add([[1, 2]], SamplingParams(tokens_to_generate=2, logit_bias=[(8, 1.0)]))
    # a negative id silently banned a token counted from the vocabulary's end; 2^63 overflowed a tensor (HTTP 500)
    for field, bad in (("stop_token_ids", 2**63), ("banned_ids", -1), ("double_stop_ids", 8), ("ban_after_ids", 9)):
        params = SamplingParams(tokens_to_generate=2, **{field: (1, bad)})
        with pytest.raises(ValueError, match=f"^{field}: token id {bad} is outside the vocabulary \\[0, 8\\)"):
            engine.generate([[1, 2]], params)
        with pytest.raises(ValueError, match=f"^{field}: token id {bad} is outside the vocabulary"):
            Scheduler(engine, 2).add([[1, 2]], params)


def test_prompts_too_long_or_empty_are_refused(checkpoints):
    engine = engine_for(checkpoints["gpt"])
    with pytest.raises(ValueError, match="prompt 1 has 90 tokens \\+ 10 tokens to generate, more than the model's 96"):
        engine.generate([[1], [2] * 90], SamplingParams(tokens_to_generate=10))
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        engine.generate([[]], SamplingParams())


def test_generate_tool_batches_prompts_and_prints_log_probs(checkpoints, capsys):
    from tests.tools import load_tool

    gen = load_tool("generate")
    batch = prompts(2, lengths=(4, 6))
    argv = ["--load", checkpoints["gpt"], "--greedy", "--max-new-tokens", "5", "--log-probs"]
    for p in batch:
        argv += ["--prompt", " ".join(map(str, p))]
    assert gen.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    want = engine_for(checkpoints["gpt"]).generate(batch, SamplingParams(tokens_to_generate=5, top_k=1))
    texts = [line for line in lines if not line.startswith("  ")]
    assert texts == [" ".join(map(str, g.tokens)) for g in want]
    first = lines[1:len(want[0].tokens)]  # the first sequence's tokens after its first, with log-probs
    assert [int(line.split()[0]) for line in first] == want[0].tokens[1:]
    assert_close(torch.tensor([float(line.split()[1]) for line in first]), torch.tensor(want[0].log_probs), rtol=1e-4)
    assert gen.main(["--load", checkpoints["gpt"], "--prompt", " ".join(["1"] * 90), "--max-new-tokens", "10"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: prompt 0 has 90 tokens + 10 tokens to generate") and err.count("\n") == 1


@pytest.mark.parametrize("tool", ["generate", "evaluate"])
@pytest.mark.parametrize("value", ["0", "-5"])
def test_a_max_sequence_length_below_one_names_the_flag(checkpoints, capsys, tmp_path, tool, value):
    from tests.tools import load_tool

    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "1 2 3 4"}\n')
    task = ["--prompt", "1 2"] if tool == "generate" else ["--task", "WIKITEXT103", "--valid-data", str(data)]
    assert load_tool(tool).main(["--load", checkpoints["gpt"], "--max-sequence-length", value, *task]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --max-sequence-length {value} must be at least 1") and err.count("\n") == 1


@pytest.mark.parametrize("tool", ["generate", "evaluate"])
def test_a_max_sequence_length_beyond_the_learned_positions_is_refused_not_cut(checkpoints, capsys, tmp_path, tool):
    from megatron_lite.checkpoint import merge_checkpoint
    from megatron_lite.inference.loading import context_limit
    from tests.tools import load_tool

    _, saved = merge_checkpoint(checkpoints["gpt"])
    limit = context_limit(saved)
    assert saved.get("position_embedding_type", "learned_absolute") == "learned_absolute"
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "1 2 3 4"}\n')
    task = ["--prompt", "1 2"] if tool == "generate" else ["--task", "WIKITEXT103", "--valid-data", str(data)]
    assert load_tool(tool).main(["--load", checkpoints["gpt"], "--max-sequence-length", str(limit + 1), *task]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --max-sequence-length {limit + 1}: the model has learned positions for {limit} "
                          "tokens only") and err.count("\n") == 1


MODEL_VOCAB = 640  # the model's rows over the ~600 ids of the tokenizers below (as Qwen's 151936 over 151665)


@pytest.fixture(scope="module")
def small_tokenizers(tmp_path_factory):
    """``gpt`` checkpoints of MODEL_VOCAB ids trained with a smaller GPT-2 BPE / SentencePiece tokenizer."""
    from megatron_lite.data.tokenizers import build_tokenizer
    from tests.preprocess_helpers import make_tok_files

    files, roots = make_tok_files(tmp_path_factory), {}
    for kind in ("GPT2BPETokenizer", "SentencePieceTokenizer"):
        fields = {"tokenizer_type": kind, **files[kind]}
        size = build_tokenizer(**fields).vocab_size
        assert size < MODEL_VOCAB
        roots[kind] = str(tmp_path_factory.mktemp(kind))
        save_model("gpt", roots[kind], tokenizer=fields, vocab=MODEL_VOCAB,
                   adjust=lambda m, size=size: prefer_ids_from(m, size))
    return roots


def test_unprintable_ids_are_those_past_the_tokenizer_and_its_gaps():
    from types import SimpleNamespace

    from megatron_lite.inference.sampling import unprintable_ids

    gaps = SimpleNamespace(vocab_size=5, inv_vocab={0: "a", 1: "b", 3: "d", 4: "e"})  # a vocab.json without id 2
    assert unprintable_ids(gaps, 7).tolist() == [False, False, True, False, False, True, True]
    assert unprintable_ids(SimpleNamespace(vocab_size=7), 7) is None and unprintable_ids(None, 7) is None


@pytest.mark.parametrize("kind", ["GPT2BPETokenizer", "SentencePieceTokenizer"])
@pytest.mark.parametrize("top_k, use_cache", [(1, True), (1, False), (0, True), (0, False)])
def test_a_model_vocabulary_larger_than_the_tokenizer_generates_only_printable_ids(small_tokenizers, kind, top_k,
                                                                                    use_cache):
    from megatron_lite.inference.loading import load_tokenizer

    model, saved = load_model(small_tokenizers[kind])
    tokenizer = load_tokenizer(saved)
    size = tokenizer.vocab_size
    prompt = tokenizer.tokenize("The quick brown fox")
    params = SamplingParams(tokens_to_generate=12, top_k=top_k, random_seed=5, stop_on_eod=False, top_n_logprobs=3)
    blind = InferenceEngine(model, vocab_size=MODEL_VOCAB, max_sequence_length=MAX_LEN, eod=tokenizer.eod)
    assert all(t >= size for t in blind.generate([prompt], params)[0].generated)  # the model prefers them
    engine = InferenceEngine(model, vocab_size=MODEL_VOCAB, max_sequence_length=MAX_LEN, eod=tokenizer.eod,
                             use_cache=use_cache, tokenizer=tokenizer)
    out = engine.generate([prompt], params)[0]
    assert len(out.generated) == 12 and all(t < size for t in out.generated)
    assert all(t < size for row in out.top_log_probs for t, _ in row)
    assert isinstance(tokenizer.detokenize(out.tokens), str)
    with torch.no_grad():  # the log-probs stay those of the softmax over all MODEL_VOCAB ids
        logits = model(torch.tensor([out.tokens]))[0, :-1, :MODEL_VOCAB].float()
    want = logits.log_softmax(-1).gather(-1, torch.tensor(out.tokens[1:]).unsqueeze(-1)).squeeze(-1)
    assert_close(torch.tensor(out.log_probs), want)
    if top_k == 1:  # greedy: the most likely printable id
        assert out.generated == logits[len(prompt) - 1:, :size].argmax(-1).tolist()


@pytest.mark.parametrize("kind", ["GPT2BPETokenizer", "SentencePieceTokenizer"])
def test_generate_tool_prints_a_model_vocabulary_larger_than_its_tokenizer(small_tokenizers, kind, capsys):
    from tests.tools import load_tool

    for sampling in (["--greedy"], ["--top-k", "5"]):
        argv = ["--load", small_tokenizers[kind], "--prompt", "The quick brown fox", "--max-new-tokens", "8"]
        assert load_tool("generate").main(argv + sampling) == 0
        assert capsys.readouterr().out.startswith("The quick brown fox")


def test_beam_search_and_continuous_batching_choose_only_printable_ids(small_tokenizers):
    from megatron_lite.inference.loading import load_tokenizer
    from megatron_lite.inference.scheduler import Scheduler
    from tests.batching_helpers import run

    model, saved = load_model(small_tokenizers["GPT2BPETokenizer"])
    tokenizer = load_tokenizer(saved)
    size, prompt = tokenizer.vocab_size, tokenizer.tokenize("The quick brown fox")
    engine = InferenceEngine(model, vocab_size=MODEL_VOCAB, max_sequence_length=MAX_LEN, eod=tokenizer.eod,
                             tokenizer=tokenizer)
    beams = engine.generate([prompt], SamplingParams(tokens_to_generate=6, beam_width=3, stop_on_eod=False))
    assert len(beams) == 3 and all(t < size for b in beams for t in b.generated)
    requests = [([prompt], SamplingParams(tokens_to_generate=8, top_k=1, top_n_logprobs=2)),
                ([prompt, prompt[:2]], SamplingParams(tokens_to_generate=6, top_k=5, random_seed=1))]
    batched, _, _ = run(Scheduler(engine, 4), requests, [0, 1])
    for i, request in enumerate(requests):
        alone = engine.generate(*request)
        assert [g.tokens for g in batched[i]] == [g.tokens for g in alone]
        assert all(t < size for g in batched[i] for t in g.generated)
    assert all(t < size for pos in batched[0][0].top_log_probs for t, _ in pos)


def test_a_prompt_id_outside_the_model_vocabulary_is_one_clear_error(checkpoints, capsys):
    from tests.tools import load_tool

    engine = engine_for(checkpoints["gpt"])  # VOCAB ids, an embedding padded to 104 rows
    for call in (lambda p: engine.generate(p, SamplingParams(tokens_to_generate=2)), engine.score):
        for bad in (VOCAB + 1, -1):
            with pytest.raises(ValueError, match=f"prompt 1 holds token id {bad}, outside the model's vocabulary"):
                call([[1, 2], [3, bad, 4]])
    # a NullTokenizer override of more ids than the model's (103 <= its 104 padded rows: the tokenizer loads)
    argv = ["--load", checkpoints["gpt"], "--tokenizer-type", "NullTokenizer", "--vocab-size", "102",
            "--prompt", f"3 {VOCAB + 1} 4", "--max-new-tokens", "2"]
    assert load_tool("generate").main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: prompt 0 holds token id {VOCAB + 1}") and err.count("\n") == 1
