"""``--transformer-impl transformer_engine`` wiring, against a stand-in TE package.

Transformer Engine needs CUDA, so these tests run :mod:`tests.fake_transformer_engine` (records each
Linear call with the active ``fp8_autocast`` settings, computes in fp32). They prove that

* our FP8 flags map onto TE's recipe fields (format, margin, history length, amax algorithm,
  ``--no-fp8-wgrad``; tensorwise -> current scaling, blockwise/mxfp8 -> TE's block-scaled recipes);
* every GEMM of every transformer layer (QKV, attention projection, fc1, fc2, and each expert's fc1
  and fc2) goes through TE, under an autocast enabled exactly for the FP8 layers, with the gemm's
  amax group (TP x CP; one process: none) as TE's; the embedding and output layer do not;
* TE runs on our weights: the fp32 model through the fake equals the local model (the fake's own
  weights are NaN), also where an expert's token count was padded to 16 rows for FP8;
* without TE (or without a GPU) the request is one ConfigError line naming what is missing and the fix;
  ``--no-fp8-wgrad`` with a current-scaling recipe, which TE's recipes cannot express, is refused while
  the flags are parsed (one line, exit 2, nothing on disk), not when the first layer is built.

They do not show that the real Transformer Engine accepts these calls: that path has not run on TE.
"""

import pytest
import torch

from megatron_lite.errors import ConfigError
from megatron_lite.models import GPTModel, TransformerConfig
from megatron_lite.parallel.state import ParallelState
from megatron_lite.precision.fp8 import Fp8Recipe
from megatron_lite.precision.te import TeGemm, te_recipe
from tests import fake_transformer_engine as fake
from tests.cli_errors import parse_refused

SHAPE = dict(num_layers=3, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=64,
             attention_dropout=0.0, hidden_dropout=0.0, seed=5)


@pytest.mark.parametrize("ours, want", [
    (dict(format="hybrid", margin=0, amax_history_len=1, amax_compute_algo="most_recent"),
     fake.DelayedScaling(margin=0, fp8_format=fake.Format.HYBRID, amax_history_len=1, amax_compute_algo="most_recent")),
    (dict(format="e4m3", margin=2, amax_history_len=16, amax_compute_algo="max", wgrad=False),
     fake.DelayedScaling(margin=2, fp8_format=fake.Format.E4M3, amax_history_len=16, amax_compute_algo="max",
                         override_linear_precision=(False, False, True))),
    (dict(format="e4m3", recipe="tensorwise"), fake.Float8CurrentScaling(fp8_format=fake.Format.E4M3)),
    (dict(format="hybrid", recipe="blockwise"), fake.Float8BlockScaling(fp8_format=fake.Format.HYBRID)),
    (dict(format="e4m3", recipe="mxfp8"), fake.MXFP8BlockScaling(fp8_format=fake.Format.E4M3)),
])
def test_recipe_fields_map_from_our_flags(monkeypatch, ours, want):
    fake.install(monkeypatch)
    import transformer_engine.common.recipe as recipe_module
    assert te_recipe(Fp8Recipe(**ours), recipe_module) == want
    assert te_recipe(None, recipe_module) is None


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise", "mxfp8"])
def test_no_fp8_wgrad_with_a_current_scaling_recipe_is_refused_through_te(monkeypatch, recipe):
    fake.install(monkeypatch)
    import transformer_engine.common.recipe as recipe_module
    with pytest.raises(ConfigError, match=f"--no-fp8-wgrad with --fp8-recipe {recipe} is not available"):
        te_recipe(Fp8Recipe(recipe=recipe, wgrad=False), recipe_module)


@pytest.mark.parametrize("recipe", ["tensorwise", "mxfp8"])
def test_no_fp8_wgrad_through_te_is_refused_before_any_work(monkeypatch, capsys, tmp_path, recipe):
    """It was refused only when TeGemm was built: after the startup log and after the save and
    TensorBoard folders were made (left empty). Now the flags' check refuses it."""
    import pretrain_gpt

    fake.install(monkeypatch)
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--vocab-size", "64", "--micro-batch-size", "2", "--mock-data", "--bf16", "--fp8-format", "hybrid",
            "--fp8-recipe", recipe, "--transformer-impl", "transformer_engine", "--no-fp8-wgrad"]
    words = ("--no-fp8-wgrad", f"--fp8-recipe {recipe}", "--transformer-impl local")
    parse_refused(capsys, argv, *words, world_size=1)
    save = tmp_path / "save"
    with pytest.raises(SystemExit) as err:
        pretrain_gpt.main(argv + ["--train-iters", "2", "--lr-warmup-iters", "0", "--save", str(save),
                                  "--tensorboard-dir", str(tmp_path / "tb")])
    assert err.value.code == 2 and not save.exists() and not (tmp_path / "tb").exists()
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def _model(impl, moe, **fields):
    extra = dict(num_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2) if moe else {}
    return GPTModel(TransformerConfig(**SHAPE, transformer_impl=impl, **extra, **fields), ParallelState())


@pytest.mark.parametrize("moe", [False, True])
def test_every_transformer_layer_gemm_goes_through_te_on_our_weights(monkeypatch, moe):
    calls = fake.install(monkeypatch)
    local = _model("local", moe)
    te = _model("transformer_engine", moe, fp8="hybrid", fp8_margin=1, fp8_amax_history_len=4,
                fp8_amax_compute_algo="max", first_last_layers_bf16=True)
    gemms = [m for m in te.modules() if isinstance(m, TeGemm)]
    per_layer = 2 + (2 * 4 if moe else 2)  # qkv, proj + fc1, fc2 (of each expert)
    assert len(gemms) == 3 * per_layer  # not the embedding or the output layer
    assert not any(k.endswith("_extra_state") or "_linear" in k for k in te.state_dict())
    te.load_state_dict(local.state_dict())  # the same parameters, nothing else
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    want, got = local(tokens), te(tokens)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    got.float().logsumexp(-1).mean().backward()
    want.float().logsumexp(-1).mean().backward()
    for (name, a), b in zip(te.named_parameters(), local.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    assert len(calls) == 3 * per_layer  # each GEMM once per forward (an expert without tokens too)
    enabled = [c["enabled"] for c in calls]
    assert enabled == [False] * (len(calls) // 3) + [True] * (len(calls) // 3) + [False] * (len(calls) // 3)
    recipes = {id(c["recipe"]) for c in calls if c["enabled"]}
    assert len(recipes) == per_layer  # one recipe object per gemm, all with our fields
    for c in calls:
        assert c["group"] is None  # one process: no TP group
        if c["enabled"]:  # FP8 GEMMs get 16-aligned token counts (experts' are padded with zero rows)
            assert c["rows"] % 16 == 0, c
            assert c["recipe"] == fake.DelayedScaling(margin=1, fp8_format=fake.Format.HYBRID, amax_history_len=4,
                                                      amax_compute_algo="max")


def test_missing_transformer_engine_or_gpu_is_one_line(monkeypatch):
    fake.install(monkeypatch, gpu=False)
    with pytest.raises(ConfigError) as err:
        _model("transformer_engine", False)
    assert "no CUDA GPU is visible" in str(err.value) and "use --transformer-impl local" in str(err.value)
    assert "Transformer Engine is not installed" not in str(err.value)
    with pytest.raises(ConfigError, match="--transformer-impl te: expected one of local, transformer_engine"):
        _model("te", False)


def test_without_te_installed_the_request_names_the_fix():
    from megatron_lite.precision.flags import transformer_engine_missing
    if not transformer_engine_missing():
        pytest.skip("Transformer Engine and a GPU are present")
    with pytest.raises(ConfigError, match="--transformer-impl transformer_engine: .*use --transformer-impl local"):
        _model("transformer_engine", False)
