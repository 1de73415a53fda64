"""--fp32-residual-connection: the residual stream in fp32 while the layers compute in bf16/fp16.

The embedding's output, every layer's input and output (the residual adds) and what crosses pipeline
stages are fp32; each norm takes the fp32 stream and returns the model's dtype, in which attention and
the MLP run. A bf16 model with the flag is closer to the fp32 model than without it.
"""

import pytest
import torch

from megatron_lite.arguments import parse_args
from megatron_lite.models import GPTModel, TransformerConfig
from megatron_lite.models.common import Norm
from megatron_lite.parallel.state import ParallelState
from megatron_lite.training.step import pipe_comm
from tests.cli_errors import parse_refused
from tests.model_helpers import FUSION_MODEL

TOKENS = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))


def _gpt(dtype, fp32_residual=False, **model):
    config = TransformerConfig(**{**FUSION_MODEL, "params_dtype": dtype, "fp32_residual_connection": fp32_residual,
                                  **model})
    torch.manual_seed(0)
    return GPTModel(config, ParallelState())


def _record_dtypes(model):
    """Run TOKENS through ``model``; {what: dtype} of the stream and of the layers' compute."""
    seen = {}

    def hook(name):
        def record(module, args, out):
            seen.setdefault(name + " in", args[0].dtype)
            seen.setdefault(name + " out", (out[0] if isinstance(out, tuple) else out).dtype)
        return record

    model.embedding.register_forward_hook(hook("embedding"))
    for i, layer in enumerate(model.decoder.layers):
        layer.register_forward_hook(hook(f"layer{i}"))
        layer.input_norm.register_forward_hook(hook(f"layer{i} norm"))
        layer.self_attention.linear_qkv.register_forward_hook(hook(f"layer{i} qkv"))
    model.decoder.final_norm.register_forward_hook(hook("final norm"))
    model(TOKENS).float().sum().backward()
    return seen


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_residual_stream_is_fp32_with_the_flag(dtype):
    seen = _record_dtypes(_gpt(dtype, fp32_residual=True))
    assert seen["embedding out"] == torch.float32
    for i in range(2):
        assert seen[f"layer{i} in"] == seen[f"layer{i} out"] == torch.float32  # the residual adds in fp32
        assert seen[f"layer{i} norm in"] == torch.float32 and seen[f"layer{i} norm out"] == dtype
        assert seen[f"layer{i} qkv in"] == seen[f"layer{i} qkv out"] == dtype  # the GEMMs stay 16-bit
    assert seen["final norm in"] == torch.float32 and seen["final norm out"] == dtype
    without = _record_dtypes(_gpt(dtype))
    assert {d for k, d in without.items() if k != "embedding in"} == {dtype}  # without: all in the model's dtype


def test_fp32_model_unchanged_by_the_flag():
    """In fp32 the flag changes nothing: identical logits."""
    assert torch.equal(_gpt(torch.float32, True)(TOKENS), _gpt(torch.float32)(TOKENS))


def test_bf16_with_the_flag_is_closer_to_fp32():
    """The same (bf16-representable) weights; 6 layers whose residual adds would each round to bf16:
    with the stream in fp32 the logits and the embedding's gradient are nearer the fp32 model's."""
    model = dict(num_layers=6, hidden_size=64, ffn_hidden_size=128, init_method_std=0.05)
    plain, fp32_res = _gpt(torch.bfloat16, **model), _gpt(torch.bfloat16, True, **model)
    reference = _gpt(torch.float32, **model)
    reference.load_state_dict(plain.state_dict())  # the bf16 weights, exactly, in fp32
    fp32_res.load_state_dict(plain.state_dict())

    def logits_and_grad(m):
        m.zero_grad()
        out = m(TOKENS).float()
        (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
        return out.detach(), m.embedding.word_embeddings.weight.grad.float()

    ref_out, ref_grad = logits_and_grad(reference)
    errors = {}
    for name, m in (("plain", plain), ("fp32 residual", fp32_res)):
        out, grad = logits_and_grad(m)
        errors[name] = ((out - ref_out).norm() / ref_out.norm()).item(), ((grad - ref_grad).norm() / ref_grad.norm()).item()
    assert errors["fp32 residual"][0] < 0.8 * errors["plain"][0], errors
    assert errors["fp32 residual"][1] <= 1.05 * errors["plain"][1], errors  # the gradient: no worse


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_norm_of_an_fp32_stream_equals_the_fp32_norm_rounded(kind):
    norm = Norm(16, kind, dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 16))
    x = torch.randn(3, 2, 16) * 4 + 1
    reference = Norm(16, kind)
    reference.load_state_dict(norm.state_dict())
    out = norm(x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, reference(x).to(torch.bfloat16))


@pytest.mark.parametrize("flags, dtype", [([], torch.bfloat16), (["--fp32-residual-connection"], torch.float32)])
def test_pipeline_stages_exchange_the_stream_dtype(flags, dtype):
    """What crosses a pipeline stage is the residual stream: fp32 with the flag, so the p2p buffers are."""
    config = parse_args(["--mock-data", "--vocab-size", "64", "--bf16", "--num-layers", "2", "--hidden-size", "32",
                         "--num-attention-heads", "4", "--seq-length", "16"] + flags, world_size=1)
    assert TransformerConfig.from_config(config).fp32_residual_connection == bool(flags)
    assert pipe_comm(config, ParallelState()).dtype == dtype


@pytest.mark.parametrize("flag", ["--fp32-residual-connection", "--attention-softmax-in-fp32",
                                  "--apply-query-key-layer-scaling"])
def test_16_bit_numerics_flags_refused_in_fp32(capsys, flag):
    """Each keeps part of a 16-bit model in fp32; in an fp32 run it would change nothing: one line, exit 2."""
    base = ["--mock-data", "--vocab-size", "64"]
    parse_refused(capsys, base + [flag], flag, "no effect in fp32", "--bf16")
    parse_args(base + [flag, "--bf16"], world_size=1)  # accepted with 16-bit training


def test_a_spec_norm_of_the_fp32_stream_is_cast_to_the_model_dtype():
    """examples/research/dyt.py's norm returns fp32 for the fp32 stream; the layer, the final norm and the
    multi-token prediction layer (its enorm / hnorm before eh_proj) cast its output to bf16, so the GEMMs
    after it still take bf16 (without the casts the output layer and eh_proj refuse the fp32 input)."""
    from megatron_lite.models.spec_plugin import layer_specs

    spec = layer_specs("examples/research/dyt.py", "spec", 2)[0]
    config = TransformerConfig(**{**FUSION_MODEL, "params_dtype": torch.bfloat16, "fp32_residual_connection": True,
                                  "position_embedding_type": "rope", "mtp_num_layers": 1})
    torch.manual_seed(0)
    model = GPTModel(config, ParallelState(), spec=spec)
    seen = {}
    model.decoder.final_norm.register_forward_hook(lambda m, a, out: seen.update({"final norm": out.dtype}))
    losses = model(TOKENS, labels=TOKENS, mtp_tokens=[TOKENS.roll(-1, 1)], mtp_labels=[TOKENS.roll(-2, 1)])
    assert losses.shape[0] == 2  # the main head and the MTP layer's
    losses.float().mean().backward()
    assert seen["final norm"] == torch.float32  # the spec's norm itself
    assert model.embedding.word_embeddings.weight.grad is not None
