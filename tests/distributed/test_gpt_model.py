"""Tensor- (and sequence-) parallel GPTModel equals the single-process GPTModel, on real gloo groups.

Every rank builds the single-process model (group of one) and the TP model from the same seed
and runs the same batch. Compared: the initial weights (each TP shard gathered and unsharded
must equal the full weight exactly), the per-token loss, and every parameter gradient (TP grads
gathered with ``unshard``; replicated norm / bias / position-embedding grads after
``all_reduce_sequence_parallel_grads``). fp32, rtol 1e-5, atol 1e-6 for losses and 1e-7 for
gradients (gradients are ~1e-4..1e-2; only the summation order differs). Dropout is 0 so the
two computations are the same function; test_gpt_model.py in unit/ covers dropout under recompute.
"""

import pytest
import torch
import torch.distributed as dist

from megatron_lite.parallel.state import ParallelState
from megatron_lite.parallel.tensor import all_reduce_sequence_parallel_grads, unshard
from tests.harness import cached_state, run_ranks
from tests.model_helpers import build_gpt
from tests.unit.test_gpt_model import make_batch, make_config


def _gather(t, group, tp):
    parts = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def _full(p, t, group, tp):
    """The full tensor behind this rank's shard ``t`` of parameter ``p`` (replicated: ``t`` itself)."""
    if not getattr(p, "tensor_model_parallel", False):
        return t
    return unshard(_gather(t, group, tp), p.partition_dim, getattr(p, "partition_stride", 1))


def check_tp_equals_serial(tp, sp, variant, recompute=None):
    state = cached_state(tp=tp)
    g = state.tp_group
    cfg = make_config(variant)
    tokens, labels = make_batch(4)

    serial = build_gpt(cfg, ParallelState(world_size=1, rank=0), seed=9)
    loss_ref = serial(tokens, labels=labels)
    loss_ref.mean().backward()

    rec = dict(recompute_granularity=recompute[0], recompute_method=recompute[1], recompute_num_layers=recompute[2]) \
        if recompute else {}
    model = build_gpt(cfg, state, seed=9, sequence_parallel=sp, **rec)
    loss = model(tokens, labels=labels)
    loss.mean().backward()
    all_reduce_sequence_parallel_grads(model.parameters(), g)

    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-6)
    ref_params = dict(serial.named_parameters())
    names = [n for n, _ in model.named_parameters()]
    assert names == list(ref_params), "same parameter names as the single-process model"
    sp_marked = []
    for name, p in model.named_parameters():
        ref = ref_params[name]
        torch.testing.assert_close(_full(p, p.detach(), g, tp), ref.detach(), rtol=0, atol=0,
                                   msg=lambda m, name=name: f"initial weight {name}: {m}")
        torch.testing.assert_close(_full(p, p.grad, g, tp), ref.grad, rtol=1e-5, atol=1e-7,
                                   msg=lambda m, name=name: f"grad {name}: {m}")
        if getattr(p, "sequence_parallel", False):
            sp_marked.append(name)
    return sorted(sp_marked)


CASES = [(tp, sp, v) for tp in (2, 4) for sp in (False, True) for v in ("A", "B")]


@pytest.mark.parametrize("tp, sp, variant", CASES)
def test_tensor_parallel_equals_single_process(tp, sp, variant):
    marked = run_ranks(tp, check_tp_equals_serial, tp, sp, variant)[0]
    if not sp:
        assert marked == []
    else:  # every replicated parameter that sees only a sequence shard is marked, and nothing else
        expect = {"decoder.final_norm.weight"}
        for i in range(2):
            expect |= {f"decoder.layers.{i}.{n}.weight" for n in ("input_norm", "pre_mlp_norm")}
            if variant == "A":
                expect |= {f"decoder.layers.{i}.{n}.bias" for n in
                           ("input_norm", "pre_mlp_norm", "self_attention.linear_proj", "mlp.linear_fc2")}
        if variant == "A":
            expect |= {"decoder.final_norm.bias", "embedding.position_embeddings.weight"}
        assert marked == sorted(expect)


def check_init_equals_serial(tp, variant):
    """Every TP shard of the initial weights is the slice of the one-process weight, exactly."""
    state = cached_state(tp=tp)
    serial = dict(build_gpt(make_config(variant), ParallelState(world_size=1, rank=0), seed=9).named_parameters())
    model = build_gpt(make_config(variant), state, seed=9, sequence_parallel=True)
    for name, p in model.named_parameters():
        torch.testing.assert_close(_full(p, p.detach(), state.tp_group, tp), serial[name].detach(), rtol=0, atol=0,
                                   msg=lambda m, name=name: f"initial weight {name}: {m}")


def test_init_flags_are_the_same_weights_at_tp2():
    """--init-method-xavier-uniform with --embedding-init-method-std (variant X): the bounds come from the
    whole matrix, so TP2's shards are the one-process weights' slices."""
    run_ranks(2, check_init_equals_serial, 2, "X")


@pytest.mark.parametrize("variant", ["Q", "P", "N", "R"])
def test_family_options_under_tensor_sequence_parallel(variant):
    """--add-qkv-bias (variant Q: the QKV bias splits with its weight, whole key/value groups per rank),
    --rotary-percent 0.5 (variant P), --apply-layernorm-1p (variant N: the zero-centred norm weights'
    sequence-parallel gradients) and --apply-residual-connection-post-layernorm (variant R: the residuals
    are the norms' sequence shards)."""
    run_ranks(2, check_tp_equals_serial, 2, True, variant)


@pytest.mark.parametrize("sp, variant", [(False, "K"), (True, "K"), (True, "L")])
def test_qk_layernorm_under_tensor_parallel(sp, variant):
    """--qk-layernorm (K: RMSNorm, GQA; L: LayerNorm + bias, MHA): each rank norms only its heads, so the
    replicated q/k norm weights are marked and summed over TP with or without SP; their gradients
    (and every other one) equal one process'."""
    marked = run_ranks(2, check_tp_equals_serial, 2, sp, variant)[0]
    kinds = ("weight", "bias") if variant == "L" else ("weight",)
    norms = {f"decoder.layers.{i}.self_attention.{n}_layernorm.{k}" for i in range(2) for n in "qk" for k in kinds}
    assert norms <= set(marked) and (sp or set(marked) == norms)


def test_tensor_sequence_parallel_with_full_recompute():
    run_ranks(2, check_tp_equals_serial, 2, True, "B", ("full", "uniform", 1))
    run_ranks(2, check_tp_equals_serial, 2, True, "K", ("full", "uniform", 1))  # --qk-layernorm
    run_ranks(2, check_tp_equals_serial, 2, True, "A", ("selective", None, None))
    run_ranks(2, check_tp_equals_serial, 2, True, "R", ("full", "block", 1))  # residuals from the norms


def check_recompute_with_dropout(tp, recompute):
    """Under TP + SP with dropout on, recomputation replays the TP-stream and default-stream masks."""
    from megatron_lite.parallel.random import model_parallel_seed

    state = cached_state(tp=tp)
    cfg = make_config("B", dropout=0.2)
    tokens, labels = make_batch(6)
    runs = []
    for rec in (None, recompute):
        model_parallel_seed(13, state)
        names = ("recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules")
        kw = dict(zip(names, rec)) if rec else {}
        model = build_gpt(cfg, state, seed=9, sequence_parallel=True, **kw)
        loss = model(tokens, labels=labels)
        loss.mean().backward()
        runs.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss_ref, grads_ref), (loss, grads) = runs
    torch.testing.assert_close(loss, loss_ref, rtol=0, atol=0)
    for name, g in grads_ref.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    return loss_ref


@pytest.mark.parametrize("recompute", [("full", "uniform", 2), ("full", "block", 1), ("selective", None, None),
                                       ("selective", None, None, ["core_attn", "mlp", "layernorm"])])
def test_recompute_with_dropout_under_tensor_sequence_parallel(recompute):
    losses = run_ranks(2, check_recompute_with_dropout, 2, recompute)
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)  # every TP rank computes the same loss


def check_pipeline_split_under_tp(tp):
    """Two pipeline stages (run back to back on the same ranks) under TP + SP with rope: the second
    stage receives the sequence shard and must rebuild the full-length rotary table."""
    state = cached_state(tp=tp)
    cfg = make_config("B")
    tokens, labels = make_batch(7)
    serial = build_gpt(cfg, ParallelState(world_size=1, rank=0), seed=9)
    first = build_gpt(cfg, state, seed=9, sequence_parallel=True, post_process=False, layer_end=1)
    last = build_gpt(cfg, state, seed=9, sequence_parallel=True, pre_process=False, layer_start=1)
    hidden = first(tokens)
    assert hidden.shape == (16 // tp, 2, 32)
    last.set_input_tensor(hidden)
    torch.testing.assert_close(last(tokens, labels=labels), serial(tokens, labels=labels), rtol=1e-5, atol=1e-6)


def test_pipeline_split_under_tensor_sequence_parallel():
    run_ranks(2, check_pipeline_split_under_tp, 2)


def check_bad_tp_shapes(tp):
    state = cached_state(tp=tp)
    messages = []
    for over in (dict(num_attention_heads=8, num_query_groups=2), dict(padded_vocab_size=130)):
        with pytest.raises(ValueError) as err:
            build_gpt(make_config("B", **over), state)
        messages.append(str(err.value))
    model = build_gpt(make_config("A"), state, sequence_parallel=True)
    with pytest.raises(ValueError) as err:
        model(torch.zeros(2, 6, dtype=torch.long))
    messages.append(str(err.value))
    return messages


def test_bad_tensor_parallel_shapes_are_clear_errors():
    assert run_ranks(4, check_bad_tp_shapes, 4)[0] == [
        "--num-query-groups 2 is not divisible by --tensor-model-parallel-size 4; every rank must hold whole key/value groups",
        "padded vocabulary size 130 (TransformerConfig.padded_vocab_size) is not divisible by "
        "--tensor-model-parallel-size 4; leave it None to pad the vocabulary to a multiple of "
        "--make-vocab-size-divisible-by x --tensor-model-parallel-size",
        "--sequence-parallel (TransformerConfig.sequence_parallel) needs the sequence length 6 of this "
        "context-parallel rank divisible by --tensor-model-parallel-size 4: give tokens of --seq-length, a "
        "multiple of --tensor-model-parallel-size x --context-parallel-size",
    ]


# ---------------------------------------------------------------------------------------------
# Checkpoints saved in parallel load into one process (tools/generate.py).

PROMPT, NEW_TOKENS = [5, 17, 42, 8, 61], 6


def _save(root, state, model, cfg):
    from megatron_lite.checkpoint import save_checkpoint
    from megatron_lite.config import Config

    config = Config(model=cfg)
    config.checkpoint.save = root
    save_checkpoint(3, [model], None, None, 0, config, state)


def _full_logits(model, ids, group, tp):
    shard = model(torch.tensor([ids]))[0, -1]
    return torch.cat(_gather(shard, group, tp))[:100]


def check_save_and_greedy(tp, variant, root):
    """Save a TP checkpoint, then greedy-decode with the TP model itself (logits gathered over TP)."""
    state = cached_state(tp=tp)
    cfg = make_config(variant)
    model = build_gpt(cfg, state, seed=21).eval()
    _save(root, state, model, cfg)
    ids, first_logits = list(PROMPT), None
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = _full_logits(model, ids, state.tp_group, tp)
            first_logits = logits if first_logits is None else first_logits
            ids.append(int(logits.argmax()))
    return ids[len(PROMPT):], first_logits


def _load_generate_tool():
    from tests.tools import load_tool

    return load_tool("generate")


@pytest.mark.parametrize("variant", ["A", "B"])
def test_tp2_checkpoint_loads_at_tp1_and_generates_the_same(variant, tmp_path, capsys):
    from megatron_lite.checkpoint import load_gpt_checkpoint
    from megatron_lite.inference.engine import InferenceEngine
    from megatron_lite.inference.sampling import SamplingParams

    root = str(tmp_path / "ckpt")
    tokens_tp, logits_tp = run_ranks(2, check_save_and_greedy, 2, variant, root)[0]
    model, _ = load_gpt_checkpoint(root)
    serial = build_gpt(make_config(variant), ParallelState(), seed=21)
    for name, tensor in serial.state_dict().items():  # merged weights == the single-process init, exactly
        torch.testing.assert_close(model.state_dict()[name], tensor, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    engine = InferenceEngine(model, vocab_size=100, max_sequence_length=16)
    torch.testing.assert_close(engine.forward(torch.tensor([PROMPT]))[0, -1], logits_tp, rtol=1e-5, atol=1e-6)
    greedy = SamplingParams(tokens_to_generate=NEW_TOKENS, top_k=1, stop_on_eod=False)
    tokens = engine.generate([PROMPT], greedy)[0].generated
    assert tokens == tokens_tp
    gen = _load_generate_tool()

    # the command line, with the NullTokenizer (text = space-separated ids)
    base = ["--load", root, "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
            "--prompt", " ".join(map(str, PROMPT)), "--max-new-tokens", str(NEW_TOKENS)]
    assert gen.main(base + ["--greedy"]) == 0
    out = capsys.readouterr().out.split()
    assert [int(t) for t in out] == PROMPT + tokens[: len(out) - len(PROMPT)]  # stops early only at eod (99)
    samples = []
    for seed in (1, 1, 2):
        assert gen.main(base + ["--temperature", "0.8", "--top-k", "5", "--seed", str(seed)]) == 0
        samples.append(capsys.readouterr().out)
    assert samples[0] == samples[1]  # same seed, same text


def check_save_tp_pp(root):
    state = cached_state(tp=2, pp=2)
    cfg = make_config("A")
    first = state.is_first_stage()
    model = build_gpt(cfg, state, seed=21, pre_process=first, post_process=not first,
                     layer_start=0 if first else 1, layer_end=1 if first else 2)
    _save(root, state, model, cfg)


def test_tp2_pp2_checkpoint_merges_into_the_single_process_model(tmp_path):
    from megatron_lite.checkpoint import load_gpt_checkpoint

    root = str(tmp_path / "ckpt")
    run_ranks(4, check_save_tp_pp, root)
    model, _ = load_gpt_checkpoint(root)
    serial = build_gpt(make_config("A"), ParallelState(), seed=21)
    assert list(model.state_dict()) == list(serial.state_dict())
    for name, tensor in serial.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], tensor, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_generate_refuses_missing_or_incomplete_checkpoints(tmp_path, capsys):
    gen = _load_generate_tool()
    assert gen.main(["--load", str(tmp_path / "nowhere"), "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "nowhere" in err
    root = tmp_path / "ckpt"
    run_ranks(4, check_save_tp_pp, str(root))
    (root / "iter_0000003" / "mp_rank_01_001" / "model_optim_rng.pt").unlink()
    assert gen.main(["--load", str(root), "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]) == 2
    err = capsys.readouterr().err
    assert "(1, 1)" in err and "incomplete" in err and err.count("\n") == 1
    # the layout in the flags' names (was "tp 2 x pp 2"), as the other checkpoint messages give it
    assert "saved with --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 but" in err, err
