"""FP8 in the model: which layers get an Fp8Gemm, how the flags map, what is refused.

The GPT test builds the same seeded model in bf16 and with FP8 and checks that (a) exactly the
QKV, attention-projection, fc1 and fc2 linears of the FP8 layers carry an Fp8Gemm (their state in
the state dict), the embedding and output layer do not, (b) the FP8 logits are within FP8 rounding
of the bf16 logits (relative Frobenius error < 0.1) yet not equal to them (the GEMMs really were
quantised), and (c) one backward records amaxes that the step update turns into scales.
"""

import pytest
import torch

from megatron_lite.arguments import parse_args
from megatron_lite.config import ModelConfig
from megatron_lite.errors import ConfigError
from megatron_lite.models import GPTModel, TransformerConfig
from megatron_lite.parallel.state import ParallelState
from megatron_lite.precision.fp8 import Fp8Gemm, fp8_gemms, update_fp8_scales
from tests.cli_errors import parse_refused

SHAPE = dict(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=64)


def _config(**fp8) -> TransformerConfig:
    return TransformerConfig(**SHAPE, params_dtype=torch.bfloat16, attention_dropout=0.0, hidden_dropout=0.0,
                             seed=3, **fp8)


def _fp8_layers(cfg):
    return [n for n in range(0, cfg.num_layers + 2) if isinstance(cfg.make_gemm(n, None), Fp8Gemm)]


def test_make_gemm_covers_transformer_layers_only():
    assert _fp8_layers(_config()) == []
    assert _fp8_layers(_config(fp8="hybrid")) == [1, 2, 3, 4]  # 0 = embedding, 5 = output layer: bf16
    assert _fp8_layers(_config(fp8="hybrid", first_last_layers_bf16=True)) == [2, 3]
    assert _fp8_layers(_config(fp8="e4m3", first_last_layers_bf16=True, num_layers_at_start_in_bf16=0,
                               num_layers_at_end_in_bf16=2)) == [1, 2]
    cfg = _config(fp8="hybrid", first_last_layers_bf16=True, num_layers_at_start_in_bf16=2, num_layers_at_end_in_bf16=2)
    assert _fp8_layers(cfg) == [] and "no layer of 4" in cfg.describe_fp8()


def test_multi_token_prediction_layers_run_in_fp8_even_with_first_last_layers_bf16():
    """Megatron-LM runs its MTP layers under the global FP8 context: the bf16 first/last layers rule
    does not reach them. Every linear of the MTP depth (eh_proj, QKV, projection, fc1, fc2) gets one."""
    from megatron_lite.precision.fp8 import fp8_gemms

    cfg = _config(fp8="hybrid", first_last_layers_bf16=True, mtp_num_layers=2, position_embedding_type="rope")
    assert _fp8_layers(cfg) == [2, 3, 5]  # 0: embedding and output layer; 5, 6: the MTP depths
    assert cfg.is_fp8_layer(6) and not cfg.is_fp8_layer(7)
    assert "layers 2-3 of 4 and the 2 MTP layers" in cfg.describe_fp8()
    model = GPTModel(_config(fp8="hybrid", first_last_layers_bf16=True, mtp_num_layers=1, position_embedding_type="rope"),
                     ParallelState())
    names = sorted(name for name, module in model.named_modules() if module in set(fp8_gemms(model)))
    mtp = [n for n in names if n.startswith("mtp.")]
    assert len(names) == 8 + 5 and len(mtp) == 5 and any("eh_proj" in n for n in mtp), names


def test_make_gemm_gives_a_fresh_gemm_with_the_configured_recipe():
    cfg = _config(fp8="e4m3", fp8_recipe="tensorwise", fp8_margin=2, fp8_amax_history_len=8,
                  fp8_amax_compute_algo="max", fp8_wgrad=False)
    a, b = cfg.make_gemm(1, None), cfg.make_gemm(1, None)
    assert a is not b
    r = a.recipe
    assert (r.format, r.recipe, r.margin, r.amax_history_len, r.amax_compute_algo, r.wgrad) == (
        "e4m3", "tensorwise", 2, 8, "max", False)
    assert a.amax_history.shape == (8, 3)


@pytest.mark.parametrize("fields, words", [
    (dict(fp8="e5m2"), "--fp8-format e5m2"),
    (dict(fp8="hybrid", fp8_recipe="nvfp4"), "--fp8-recipe nvfp4: expected one of delayed, tensorwise, blockwise, mxfp8"),
    (dict(fp8="hybrid", fp8_amax_history_len=0), "--fp8-amax-history-len"),
    # 2^18 exceeds E4M3's range: every value quantised to 0 or saturated; from ~80 on the outputs were NaN
    (dict(fp8="hybrid", fp8_margin=18), "--fp8-margin 18 must be between -17 and 17"),
    (dict(fp8="hybrid", fp8_margin=-18), "--fp8-margin -18 must be between -17 and 17"),
    (dict(fp8="hybrid", first_last_layers_bf16=True, num_layers_at_start_in_bf16=4), "exceed --num-layers 4"),
    (dict(fp8="hybrid", first_last_layers_bf16=True, num_layers_at_end_in_bf16=-1), "at least 0"),
])
def test_bad_fp8_fields_are_one_line_errors(fields, words):
    with pytest.raises(ConfigError, match=words):
        _config(**fields)


def test_gpt_with_fp8_quantises_the_four_linears_of_each_layer():
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    ref = GPTModel(_config(), ParallelState())
    model = GPTModel(_config(fp8="hybrid", first_last_layers_bf16=True), ParallelState())
    fp8_state = sorted(k for k in model.state_dict() if k.endswith(".gemm.scale"))
    assert fp8_state == [f"decoder.layers.{i}.{m}.gemm.scale" for i in (1, 2) for m in (
        "mlp.linear_fc1", "mlp.linear_fc2", "self_attention.linear_proj", "self_attention.linear_qkv")]
    assert len(fp8_gemms(model)) == 8
    model.load_state_dict(ref.state_dict(), strict=False)  # same weights (missing keys: the FP8 state)
    tensorwise = GPTModel(_config(fp8="hybrid", fp8_recipe="tensorwise"), ParallelState())
    tensorwise.load_state_dict(ref.state_dict(), strict=False)
    want = ref(tokens).float()
    got = tensorwise(tokens).float()
    err = ((got - want).norm() / want.norm()).item()
    assert 0 < err < 0.1, err
    loss = model(tokens).float().logsumexp(-1).mean()
    loss.backward()
    assert update_fp8_scales(model) == 8
    for g in fp8_gemms(model):
        assert (g.scale > 1).all() and not g.amax_history.any()  # learned scales, history rolled


def test_flags_map_to_the_transformer_config():
    base = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--vocab-size", "64", "--micro-batch-size", "2", "--mock-data", "--bf16"]
    config = parse_args(base + ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--fp8-margin", "1",
                                "--fp8-amax-history-len", "16", "--fp8-amax-compute-algo", "max", "--no-fp8-wgrad",
                                "--first-last-layers-bf16", "--num-layers-at-end-in-bf16", "2"], world_size=1)
    cfg = TransformerConfig.from_config(config)
    assert (cfg.fp8, cfg.fp8_recipe, cfg.fp8_margin, cfg.fp8_amax_history_len, cfg.fp8_amax_compute_algo) == (
        "hybrid", "tensorwise", 1, 16, "max")
    assert cfg.fp8_wgrad is False and cfg.first_last_layers_bf16 and cfg.num_layers_at_start_in_bf16 == 1
    assert _fp8_layers(cfg) == [2]
    assert TransformerConfig.from_config(parse_args(base, world_size=1)).fp8 is None
    assert config.precision.transformer_impl == "local"


@pytest.mark.parametrize("extra, words", [
    (["--fp8-recipe", "tensorwise"], ("--fp8-recipe tensorwise", "--fp8-format")),
    (["--fp8-margin", "2"], ("--fp8-margin 2", "--fp8-format")),
    (["--fp8-amax-history-len", "16"], ("--fp8-amax-history-len 16", "--fp8-format")),
    (["--fp8-amax-compute-algo", "max"], ("--fp8-amax-compute-algo max", "--fp8-format")),
    (["--no-fp8-wgrad"], ("--no-fp8-wgrad", "--fp8-format")),
    (["--first-last-layers-bf16"], ("--first-last-layers-bf16", "--fp8-format")),
    (["--fp8-format", "hybrid", "--fp8-margin", "130"], ("--fp8-margin 130", "between -17 and 17")),
    (["--fp8-format", "hybrid", "--num-layers-at-end-in-bf16", "2"],
     ("--num-layers-at-end-in-bf16 2", "--first-last-layers-bf16")),
])
def test_fp8_flags_without_fp8_are_refused(capsys, extra, words):
    """Each was accepted and changed nothing: the run trained in bf16 (or every layer in FP8)."""
    base = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--vocab-size", "64", "--micro-batch-size", "2", "--mock-data", "--bf16"]
    parse_refused(capsys, base + extra, *words, world_size=1)


def test_model_config_alone_has_no_fp8():
    """Tools that rebuild a model from a checkpoint's ModelConfig get a plain bf16/fp32 model."""
    cfg = TransformerConfig.from_model(ModelConfig(**SHAPE))
    assert cfg.fp8 is None and cfg.make_gemm(1, None) is None
