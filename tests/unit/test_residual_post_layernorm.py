"""--apply-residual-connection-post-layernorm (Megatron-LM's original BERT order): each residual add takes
the norm's output instead of the norm's input.

Here: one layer against the formula written out with the layer's own parts (dropout 0; the plain and
the fused bias-dropout-add paths), the fused path against the plain one with dropout on (same masks,
same gradients), the fp32 stream of --fp32-residual-connection, the flag from the command line to the
layers, a checkpoint served with it, and the one-line refusal of a Hugging Face export (exit 2, nothing
written). The whole GPT and BERT against the independent references: tests/unit/test_gpt_model.py
(variant R) and tests/unit/test_bert_model.py; recomputation: tests/unit/test_recompute_modules.py;
TP2 + SP: tests/distributed/test_gpt_model.py; cached decoding: tests/unit/test_inference_engine.py
(post_ln); BERT at PP2 interleaved with full recomputation through the CLI: tests/e2e/test_pretrain_bert.py.
"""

import pytest
import torch

from megatron_lite.activations import check_hf_exportable
from megatron_lite.arguments import parse_args
from megatron_lite.errors import ConfigError
from megatron_lite.inference.loading import load_model
from megatron_lite.models import GPTModel, TransformerConfig
from megatron_lite.parallel.state import ParallelState
from tests.convert_helpers import convert
from tests.inference_helpers import VOCAB, build_model, run_config, save_model
from tests.model_helpers import FUSION_MODEL

FLAG = "apply_residual_connection_post_layernorm"


def _gpt(post_ln=True, dtype=torch.float32, **over):
    config = TransformerConfig(**{**FUSION_MODEL, "params_dtype": dtype, FLAG: post_ln, **over})
    torch.manual_seed(0)
    model = GPTModel(config, ParallelState())
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # norms and biases away from 1 / 0, which would hide a term
        for p in model.parameters():
            if p.dim() == 1:
                p.add_((0.2 * torch.randn(p.shape, generator=g)).to(p.dtype))
    return model


def _plain(out):
    """A sub-module's output with the bias it left to the fused residual add added back."""
    x, bias = out if isinstance(out, tuple) else (out, None)
    return x if bias is None else x + bias


@pytest.mark.parametrize("fused", [False, True])
def test_layer_adds_the_norms_output(fused):
    layer = _gpt(bias_dropout_fusion=fused).decoder.layers[0]
    x = torch.randn(16, 2, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        n1 = layer.input_norm(x)
        h = n1 + _plain(layer.self_attention(n1, None, None, True))
        n2 = layer.pre_mlp_norm(h)
        want = n2 + _plain(layer.mlp(n2))
        torch.testing.assert_close(layer(x), want, rtol=1e-6, atol=1e-6)
        pre_norm = _gpt(post_ln=False, bias_dropout_fusion=fused).decoder.layers[0]
        assert not torch.allclose(pre_norm(x), want, atol=1e-2)  # the same weights in the pre-norm order differ


def test_fused_bias_dropout_add_equals_plain_with_dropout():
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(3))
    runs = []
    for fused in (False, True):
        model = _gpt(bias_dropout_fusion=fused, hidden_dropout=0.3).train()
        torch.manual_seed(5)
        loss = model(tokens, labels=tokens).mean()
        loss.backward()
        runs.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (plain_loss, plain_grads), (fused_loss, fused_grads) = runs
    torch.testing.assert_close(fused_loss, plain_loss, rtol=1e-6, atol=0)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_fp32_residual_connection_keeps_the_stream_fp32():
    """The norm's output (bf16) becomes the residual: it is added in fp32, so each layer still returns fp32."""
    model = _gpt(dtype=torch.bfloat16, fp32_residual_connection=True)
    seen = []
    for layer in model.decoder.layers:
        layer.register_forward_hook(lambda m, args, out: seen.append((args[0].dtype, out.dtype)))
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(4))
    model(tokens, labels=tokens).float().mean().backward()
    assert seen == [(torch.float32, torch.float32)] * 2
    assert all(p.grad is not None for p in model.parameters())


def test_flag_reaches_the_layers_from_the_command_line():
    base = ["--mock-data", "--vocab-size", "64", "--num-layers", "2", "--hidden-size", "32",
            "--num-attention-heads", "4", "--seq-length", "16"]
    config = parse_args(base + ["--apply-residual-connection-post-layernorm"], world_size=1)
    model = GPTModel(TransformerConfig.from_config(config), ParallelState())
    assert all(layer.residual_post_norm for layer in model.decoder.layers)
    assert not TransformerConfig.from_config(parse_args(base, world_size=1)).apply_residual_connection_post_layernorm


def test_a_checkpoint_is_served_with_the_flag_and_not_exported(tmp_path, capsys):
    trained = save_model("post_ln", str(tmp_path / "mega"))
    served, saved = load_model(str(tmp_path / "mega"))
    assert saved[FLAG] and all(layer.residual_post_norm for layer in served.decoder.layers)
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    # served with the saved flags' fused (tanh) bias + GeLU; build_model's MLP has the exact GeLU
    fused = GPTModel(TransformerConfig.from_model(run_config("post_ln").model, bias_activation_fusion=True),
                     ParallelState()).eval()
    fused.load_state_dict(trained.state_dict())
    with torch.no_grad():
        want = fused(tokens)[..., :VOCAB]
        assert torch.equal(served(tokens)[..., :VOCAB], want)
        assert (build_model("gpt")(tokens)[..., :VOCAB] - trained(tokens)[..., :VOCAB]).abs().max() > 0.1  # pre-norm
    capsys.readouterr()
    assert convert("GPT", "--saver", "hf", "--load-dir", tmp_path / "mega", "--save-dir", tmp_path / "hf") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--apply-residual-connection-post-layernorm" in err, err
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("style", ["gpt2", "llama", "bert", "mixtral"])
def test_hugging_face_export_is_refused_in_one_line(style):
    with pytest.raises(ConfigError) as err:
        check_hf_exportable({FLAG: True, "num_layers": 2}, style)
    message = str(err.value)
    assert "--apply-residual-connection-post-layernorm" in message and "refused" in message and "\n" not in message
    check_hf_exportable({FLAG: False}, style)
