"""examples/research/: each modification plugs in through --spec only, does what it says (checked
against the formula or an independent reference), and trains at TP2 + SP exactly as in one process
(losses and gradient norms within rtol 1e-5, tests/trajectory.py)."""

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

import pretrain_gpt
from megatron_lite.models import TransformerConfig
from megatron_lite.parallel.state import ParallelState
from tests.trajectory import (
    Trajectory,
    assert_same_trajectory,
    ranks_trajectories,
    ranks_trajectory,
    run_script,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESEARCH = os.path.join(ROOT, "examples", "research")
EXAMPLES = {"sliding_window": "spec", "squared_relu": "spec", "int8_gemm": "spec", "aux_loss": "spec", "dyt": "spec"}
ARGV = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--vocab-size", "123", "--make-vocab-size-divisible-by", "8", "--mock-data", "--attention-dropout", "0",
    "--hidden-dropout", "0", "--lr", "1e-2", "--log-interval", "1", "--eval-iters", "0", "--seed", "7",
    "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "6",
]
TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]


def example(name):
    """The example module, imported from its file (as --spec does)."""
    spec = importlib.util.spec_from_file_location(f"research_{name}", os.path.join(RESEARCH, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def spec_argv(name):
    return ARGV + ["--spec", os.path.join(RESEARCH, f"{name}.py"), EXAMPLES[name]]


@pytest.fixture(scope="module")
def runs():
    """One process (plain and each example) and TP2 + SP (each example, one pool call)."""
    single = {name: run_script("pretrain_gpt", spec_argv(name)) for name in EXAMPLES}
    single["plain"] = run_script("pretrain_gpt", ARGV)
    tp2 = dict(zip(EXAMPLES, ranks_trajectories(2, "pretrain_gpt", [spec_argv(n) + TP2 for n in EXAMPLES])))
    return single, tp2


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_example_trains_at_tp2_sp_as_in_one_process(runs, name):
    single, tp2 = runs
    assert len(single[name]) == 6 and all(torch.isfinite(torch.tensor(single[name].losses)))
    # the int8 example rounds activations per block: a last-bit change upstream (the gradient norm's
    # summation order) can flip one rounding of 1/127: measured 1.07e-5 and 4.6e-5 in gradient norms
    grad_rtol = 2e-4 if name == "int8_gemm" else None
    assert_same_trajectory(tp2[name], single[name], grad_rtol=grad_rtol, what=f"{name} TP2+SP")


def test_a_spec_modules_aux_loss_is_logged_like_the_routers(runs):
    """The penalty is reported after lm loss (the TP2 + SP comparison above checks it equals one
    process's), as the mean over micro-batches and layers of COEFF * mean |units|; a run without it
    reports lm loss alone. The loop's reduction: plugin_loss_values over modules of their own."""
    from megatron_lite.moe.metrics import plugin_loss_values

    single, _ = runs
    assert [list(step) for step in single["aux_loss"].reported] == [["lm loss", "l1_penalty"]] * 6
    assert all(0 < step["l1_penalty"] < 1e-2 for step in single["aux_loss"].reported)
    assert [list(step) for step in single["squared_relu"].reported] == [["lm loss"]] * 6
    modules = [torch.nn.Module() for _ in range(3)]
    modules[0].aux_losses, modules[1].aux_losses = {"x": torch.tensor(2.0), "y": torch.tensor(1.0)}, {"x": torch.tensor(4.0)}
    chunk = torch.nn.ModuleList(modules)
    # 2 micro-batches: x over its 2 modules (2 + 4) / 2 / 2, y over its one; the dicts are reset
    assert plugin_loss_values([chunk], ParallelState(), 2) == {"x": 1.5, "y": 0.5}
    assert modules[0].aux_losses == {} and not hasattr(modules[2], "aux_losses")


def test_each_example_changes_the_model(runs):
    single, _ = runs
    plain: Trajectory = single["plain"]
    for name in ("sliding_window", "squared_relu", "dyt"):
        assert abs(single[name].losses[0] - plain.losses[0]) > 1e-4, name
    # int8: the same model within quantisation error at step 1, but not the same numbers
    int8, first = single["int8_gemm"].losses[0], plain.losses[0]
    assert 0 < abs(int8 - first) < 1e-2 * abs(first)


def test_aux_loss_reaches_the_gradient_with_the_loops_scale(runs, tmp_path):
    """The auxiliary loss is not in the reported lm loss but in the gradient; with a large COEFF (the
    researcher's knob, edited in a copy) the step-1 gradient norm moves, and it is the same with 2
    micro-batches as with 1: the loop's backward scale (1 / micro-batches) reached the module."""
    plain = runs[0]["plain"]
    strong = tmp_path / "aux_strong.py"
    text = open(os.path.join(RESEARCH, "aux_loss.py")).read()
    assert "COEFF = 1e-2" in text
    strong.write_text(text.replace("COEFF = 1e-2", "COEFF = 1.0"))
    argv = ARGV[:-4] + ["--train-iters", "3", "--spec", str(strong), "spec"]
    two = run_script("pretrain_gpt", argv + ["--micro-batch-size", "2", "--global-batch-size", "4"])
    one = run_script("pretrain_gpt", argv + ["--micro-batch-size", "4", "--global-batch-size", "4"])
    assert abs(two.losses[0] - plain.losses[0]) <= 1e-5 * abs(plain.losses[0])
    assert abs(two.grad_norms[0] - plain.grad_norms[0]) > 1e-3 * plain.grad_norms[0]  # float noise: ~1e-7
    assert_same_trajectory(one, two, what="aux loss, 1 vs 2 micro-batches")


def test_aux_loss_keeps_its_weight_at_cp2_and_with_per_token_loss(runs, tmp_path):
    """The penalty's partials are divided over TP x CP (a CP rank holds part of the sequence: divided by
    TP alone, CP2 doubled the penalty), and with --calculate-per-token-loss multiplied by the micro-batch's
    tokens, as the routers' losses are (the loop then divides every gradient by the batch's token count:
    unweighted, the penalty all but vanished). A copy at CP2 (with the context-parallel core attention
    --spec asks for) follows one process, with and without per-token loss."""
    text = open(os.path.join(RESEARCH, "aux_loss.py")).read()
    assert "spec = LayerSpec(mlp=L1PenaltyMLP)" in text
    copy = tmp_path / "aux_cp.py"
    copy.write_text(text.replace("COEFF = 1e-2", "COEFF = 10.0").replace(
        "spec = LayerSpec(mlp=L1PenaltyMLP)", "from megatron_lite.parallel.context import ContextParallelAttention\n"
        "spec = LayerSpec(mlp=L1PenaltyMLP, core_attention=ContextParallelAttention)"))
    argv = ARGV[:-1] + ["3", "--spec", str(copy), "spec"]
    one = run_script("pretrain_gpt", argv)
    assert abs(one.grad_norms[0] - runs[0]["plain"].grad_norms[0]) > 0.1 * one.grad_norms[0]  # the penalty shows
    per_token = run_script("pretrain_gpt", argv + ["--calculate-per-token-loss"])
    assert_same_trajectory(per_token, one, what="aux loss, --calculate-per-token-loss")
    cp2 = ranks_trajectory(2, "pretrain_gpt", argv + ["--context-parallel-size", "2", "--calculate-per-token-loss"])
    assert_same_trajectory(cp2, one, what="aux loss, CP2 with --calculate-per-token-loss")


TWO_EXPERTS = '''
"""A mixture of experts of one's own, written from README's recipe: two dense experts, top-1 routing
and a Switch-style load-balancing loss (partials over TP x CP, counts summed, as moe/router.py)."""
import torch
from torch import nn

from megatron_lite.models.mlp import MLP
from megatron_lite.models.spec import LayerSpec
from megatron_lite.moe.aux_loss import attach_loss, switch_loss
from megatron_lite.parallel import comm

MARK = True


class TwoExperts(nn.Module):
    def __init__(self, config, state, layer_number):
        super().__init__()
        self.experts = nn.ModuleList(MLP(config, state, layer_number) for _ in range(2))
        self.router = nn.Linear(config.hidden_size, 2, bias=False)
        with torch.no_grad():
            self.router.weight.copy_(torch.randn(2, config.hidden_size, generator=torch.Generator().manual_seed(layer_number)))
        if MARK:  # it sees this rank's tokens only under --sequence-parallel
            self.router.weight.sequence_parallel = config.sequence_parallel
        self.group, self.aux_loss_backward_scale, self.aux_losses = state.group("tp_cp"), 1.0, {}

    def forward(self, hidden):
        probs = self.router(hidden).softmax(-1)  # [s / tp, b, 2]
        top = probs.argmax(-1, keepdim=True)
        if self.training and torch.is_grad_enabled():
            with torch.no_grad():
                counts = comm.reduce_from_tp(nn.functional.one_hot(top.flatten(), 2).sum(0).float(), self.group)
            total = top.numel() * comm.group_size(self.group)
            loss = switch_loss(probs.reshape(-1, 2), counts, total, topk=1, num_experts=2, coeff=0.5)
            probs = attach_loss(probs, loss, self.aux_loss_backward_scale)
            self.aux_losses["balance"] = self.aux_losses.get("balance", 0.0) + loss.detach() / 0.5  # logged
        outs = [(lambda o: o[0] + o[1] if isinstance(o, tuple) else o)(expert(hidden)) for expert in self.experts]
        return torch.where(top == 0, outs[0], outs[1]) * probs.gather(-1, top)


spec = LayerSpec(mlp=TwoExperts)
'''


def test_a_mixture_of_experts_of_your_own_trains_at_tp2_sp_as_in_one_process(runs, tmp_path):
    """README's recipe for an MLP of one's own: under --sequence-parallel a replicated parameter working on
    the hidden states (the router) sees only this rank's tokens and must be marked sequence_parallel
    (unmarked: step-1 gradient norms 1.559 vs 1.560, and the TP replicas drift apart); with it and a
    load-balancing loss following aux_loss.py's rules, TP2 + SP follows one process."""
    readme = " ".join(open(os.path.join(ROOT, "README.md"), encoding="utf-8").read().split())
    assert "mark it `param.sequence_parallel = config.sequence_parallel`" in readme
    path = tmp_path / "two_experts.py"
    path.write_text(TWO_EXPERTS)
    argv = ARGV[:-1] + ["3", "--spec", str(path), "spec"]
    one = run_script("pretrain_gpt", argv)
    assert abs(one.losses[0] - runs[0]["plain"].losses[0]) > 1e-4  # the experts' mixture is another model
    assert all(1.0 <= step["balance"] <= 2.0 for step in one.reported)  # logged (1: balanced, 2: all on one)
    assert_same_trajectory(ranks_trajectory(2, "pretrain_gpt", argv + TP2), one, what="two experts, TP2+SP")


def _config(**kw):
    return TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                             attention_dropout=0.0, hidden_dropout=0.0, vocab_size=64, **kw)


def test_sliding_window_masks_keys_beyond_the_window():
    mod = example("sliding_window")
    attn = mod.SlidingWindowAttention(_config(), ParallelState(), 1, window=4)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(12, 2, 4, 8, generator=g) for _ in range(3))
    out = attn(q, k, v)
    # reference: softmax over the band 0 <= i - j < 4, written out
    scores = torch.einsum("ibnd,jbnd->bnij", q, k) / 8 ** 0.5
    i = torch.arange(12)
    band = (i[:, None] - i[None, :] >= 0) & (i[:, None] - i[None, :] < 4)
    ref = torch.einsum("bnij,jbnd->ibnd", scores.masked_fill(~band, float("-inf")).softmax(-1), v)
    torch.testing.assert_close(out, ref.reshape(12, 2, 32), rtol=1e-5, atol=1e-6)
    k2, v2 = k.clone(), v.clone()
    k2[0], v2[0] = 100.0, -100.0  # a token far back
    out2 = attn(q, k2, v2)
    assert torch.equal(out2[4:], out[4:]), "queries 4+ do not see token 0"
    assert not torch.allclose(out2[:4], out[:4]), "queries 0..3 do"
    # generation with a key/value cache: the last 3 queries against all 12 keys give the same rows
    torch.testing.assert_close(attn(q[-3:], k, v), out[-3:], rtol=1e-5, atol=1e-6)


def test_squared_relu_is_the_formula():
    mod = example("squared_relu")
    mlp = mod.SquaredReLUMLP(_config(ffn_hidden_size=48), ParallelState(), 1)
    x = torch.randn(5, 2, 32, generator=torch.Generator().manual_seed(1))
    w1, b1, w2, b2 = mlp.linear_fc1.weight, mlp.linear_fc1.bias, mlp.linear_fc2.weight, mlp.linear_fc2.bias
    expected = torch.relu(x @ w1.T + b1) ** 2 @ w2.T + b2
    torch.testing.assert_close(mlp(x), expected, rtol=1e-5, atol=1e-6)


def test_dyt_is_the_formula_and_replaces_every_norm():
    """DyT fills both norms of every layer and, through the last layer's spec's final_norm, the norm
    after the last layer; each computes weight * tanh(alpha * x) + bias with its parameters marked
    sequence_parallel under --sequence-parallel (the TP2 + SP run above checks the gradients)."""
    from megatron_lite.models import GPTModel
    from megatron_lite.models.common import Norm

    mod = example("dyt")
    model = GPTModel(_config(), ParallelState(), spec=mod.spec)
    assert not any(isinstance(m, Norm) for m in model.modules())
    assert isinstance(model.decoder.final_norm, mod.DyT)
    assert sum(isinstance(m, mod.DyT) for m in model.modules()) == 2 * 2 + 1
    norm = model.decoder.final_norm
    with torch.no_grad():
        norm.alpha.fill_(0.7), norm.weight.uniform_(0.5, 1.5), norm.bias.uniform_(-0.1, 0.1)
    x = torch.randn(5, 2, 32, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(norm(x), norm.weight * torch.tanh(0.7 * x) + norm.bias)
    sp = mod.DyT(_config(sequence_parallel=True, tensor_model_parallel_size=2))
    assert all(p.sequence_parallel for p in sp.parameters()) and not any(p.sequence_parallel for p in norm.parameters())


def test_dyt_replaces_the_multi_token_prediction_norms_too():
    """With --mtp-num-layers the MTP depth's enorm, hnorm and final_layernorm follow the spec too (they
    were a hard-coded LayerNorm): no stock Norm is left anywhere in the model."""
    from megatron_lite.models import GPTModel
    from megatron_lite.models.common import Norm

    mod = example("dyt")
    model = GPTModel(_config(mtp_num_layers=1, position_embedding_type="rope"), ParallelState(), spec=mod.spec)
    assert [type(m).__name__ for m in model.modules() if isinstance(m, Norm)] == []
    depth = model.mtp.layers[0]
    assert all(isinstance(n, mod.DyT) for n in (depth.enorm, depth.hnorm, depth.final_layernorm))
    assert sum(isinstance(m, mod.DyT) for m in model.modules()) == 2 * 2 + 1 + 2 + 3  # layers, final, MTP's layer + 3


def _int8_reference(x, w, block):
    """An int8 round trip with real int8 tensors: per-block integer products, scaled back."""
    def quant(t):
        blocks = t.reshape(t.shape[0], -1, block)
        scale = blocks.abs().amax(-1, keepdim=True) / 127
        return torch.round(blocks / scale).clamp(-127, 127).to(torch.int8), scale

    qx, sx = quant(x)
    qw, sw = quant(w)
    per_block = torch.einsum("tkc,okc->tok", qx.to(torch.int32), qw.to(torch.int32))  # exact integer sums
    return (per_block.double() * sx.squeeze(-1)[:, None, :].double() * sw.squeeze(-1)[None].double()).sum(-1)


def test_int8_gemm_is_an_int8_round_trip():
    mod = example("int8_gemm")
    g = torch.Generator().manual_seed(2)
    x, w, b = torch.randn(6, 64, generator=g), torch.randn(24, 64, generator=g), torch.randn(24, generator=g)
    out = mod.int8_gemm(x, w, b)
    torch.testing.assert_close(out.double(), _int8_reference(x, w, mod.BLOCK) + b.double(), rtol=1e-5, atol=1e-5)
    exact = F.linear(x, w, b)
    error = (out - exact).abs().max()
    assert 0 < error < 0.05 * exact.abs().max(), error  # the quantisation error: present and small
    x.requires_grad_(True)
    mod.int8_gemm(x, w).sum().backward()  # straight-through: d/dx of x_q @ w_q^T
    torch.testing.assert_close(x.grad, mod.fake_quantize(w).sum(0).expand_as(x))


def test_int8_spec_replaces_every_gemm_of_attention_and_mlp():
    from megatron_lite.models import GPTModel
    from megatron_lite.parallel.tensor import ColumnParallelLinear, RowParallelLinear

    mod = example("int8_gemm")
    model = GPTModel(_config(), ParallelState(), spec=mod.spec)
    gemms = [m.gemm for layer in model.decoder.layers for m in layer.modules()
             if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    assert len(gemms) == 8 and all(g is mod.int8_gemm for g in gemms)


def test_aux_loss_gradient_is_that_of_lm_loss_plus_the_penalty():
    mod = example("aux_loss")
    mlp = mod.L1PenaltyMLP(_config(ffn_hidden_size=48), ParallelState(), 1, coeff=0.3)
    mlp.aux_loss_backward_scale = 2.5  # as if the main loss were scaled by 2.5 before backward
    x = torch.randn(5, 2, 32, generator=torch.Generator().manual_seed(3))
    g = torch.randn(5, 2, 32, generator=torch.Generator().manual_seed(4))
    (mlp(x) * g).sum().mul(2.5).backward()
    got = mlp.linear_fc1.weight.grad.clone()
    mlp.zero_grad()
    units = F.gelu(x @ mlp.linear_fc1.weight.T + mlp.linear_fc1.bias, approximate="tanh")
    main = ((units @ mlp.linear_fc2.weight.T + mlp.linear_fc2.bias) * g).sum()
    (2.5 * (main + 0.3 * units.abs().mean())).backward()
    torch.testing.assert_close(got, mlp.linear_fc1.weight.grad, rtol=1e-5, atol=1e-7)
    assert float(mlp.aux_losses["l1_penalty"]) == pytest.approx(0.3 * float(units.detach().abs().mean()), rel=1e-6)


def test_the_examples_use_only_public_seams():
    """No example edits the package: each is a file under examples/research/ that --spec loads."""
    for name in EXAMPLES:
        text = open(os.path.join(RESEARCH, f"{name}.py")).read()
        assert "pretrain_gpt" not in text.split('"""', 2)[-1]  # no import of the training script
        assert f"--spec examples/research/{name}.py" in text
    assert pretrain_gpt.main  # the examples run through the unmodified script (test above)


def test_int8_gemm_refuses_a_precision_recipe_in_one_line(capsys):
    """The README says the example refuses --fp8-format (which owns the GEMM): a one-line user error,
    exit 2, not a ValueError traceback from inside the model build."""
    with pytest.raises(SystemExit) as err:
        pretrain_gpt.main(spec_argv("int8_gemm") + ["--fp8-format", "hybrid", "--bf16"])
    assert err.value.code == 2
    lines = [line for line in capsys.readouterr().err.strip().splitlines() if "int8" in line]
    assert len(lines) == 1 and "--fp8-format" in lines[0] and "Traceback" not in lines[0], lines


def test_a_script_with_its_own_dataset_needs_no_data_flag(capsys):
    """examples/research/own_dataset.py parses its flags with data_from_script=True: it trains without
    --data-path or --mock-data, from its own dataset (the counting pattern, checked item by item), while
    pretrain_gpt.py still refuses a missing --data-path, and the script still asks for a vocabulary."""
    from megatron_lite.arguments import parse_args

    mod = example("own_dataset")
    argv = [a for a in ARGV if a != "--mock-data"]
    run = Trajectory.of(mod.main(argv))
    assert len(run) == 6 and all(torch.isfinite(torch.tensor(run.losses)))
    item = mod.CountingDataset(3, 16, 123, seed=7)[2]
    assert (item["tokens"] == (item["tokens"][0] + torch.arange(16).numpy()) % 123).all()
    assert (item["labels"][:-1] == item["tokens"][1:]).all() and item["loss_mask"].sum() == 16
    assert parse_args(argv, data_from_script=True).data.data_path is None
    at = argv.index("--vocab-size")
    no_vocab = argv[:at] + argv[at + 2:]
    for call, message in ((lambda: pretrain_gpt.main(argv), "give --data-path (or --mock-data for random tokens)"),
                          (lambda: mod.main(no_vocab), "this script's datasets provider brings the data; give "
                           "--vocab-size (or --tokenizer-type"),
                          (lambda: mod.main(argv + ["--data-path", "d", "--tokenizer-type", "NullTokenizer"]),
                           "--data-path: this script trains on its own dataset (CountingDataset); drop it")):
        capsys.readouterr()
        with pytest.raises(SystemExit) as err:
            call()
        lines = capsys.readouterr().err.strip().splitlines()
        assert err.value.code == 2 and len(lines) == 1 and message in lines[0], lines
