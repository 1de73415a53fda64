"""A tiny DeepSeek-V3-shaped model through pretrain_gpt.py: every parallel layout reproduces the single process.

The model (variant ``dsv3``): MLA with q compression, latent norms and YaRN; MoE with a sigmoid
router, expert bias, group-limited routing, a sequence-wise auxiliary loss and a shared expert, the
first layer dense; MTP depth 1 (its layer is MoE: its router's loss is logged with the others);
untied embeddings. Variant ``noq``: dense MLA without q compression, plain RoPE, tied embeddings,
MTP depth 2 (so the tied last-stage copy and the cumulative shifts are exercised). Each parallel
run reports per step ``lm loss``, ``mtp_k loss`` and the gradient norm, all within fp32 rel 1e-5 of
the module-scoped single-process reference (:func:`tests.trajectory.assert_same_trajectory`).
The final weights of each, merged from its checkpoint into the one-process layout, equal the
reference's tensor by tensor (:func:`tests.trajectory.assert_same_weights`).
Several layouts run in one pool call. Resume is bit-exact (PP2: the last stage's embedding copy and
the MTP layer saved and loaded); a torch_dist checkpoint saved at EP2 x TP2 + SP loads at PP2, and
a torch checkpoint converted by tools/checkpoint/convert.py from PP2 to TP2 resumes, both on the
reference trajectory.
"""

import pytest

from tests.e2e.test_pretrain_gpt import _argv, _one_line_exit_2
from tests.tools import load_tool
from tests.trajectory import (
    Trajectory,
    assert_same_trajectory,
    assert_same_weights,
    ranks_trajectories,
    run_script,
)

# 5 steps: the fewest after which both variants' loss is below their first (noq's 4th is above it)
ITERS, STOP = 5, 3
MLA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
       "--multi-latent-attention", "--kv-lora-rank", "8", "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4",
       "--v-head-dim", "6"]
VARIANTS = {
    "dsv3": MLA + [
        "--untie-embeddings-and-output-weights", "--q-lora-rank", "16", "--qk-layernorm", "--rope-type", "yarn",
        "--rotary-scaling-factor", "4", "--mscale", "1.0", "--mscale-all-dim", "1.0",
        "--original-max-position-embeddings", "6000",
        "--num-experts", "4", "--moe-router-topk", "2", "--moe-layer-freq", "([0]+[1]*3)", "--moe-ffn-hidden-size", "16",
        "--moe-shared-expert-intermediate-size", "16", "--moe-router-score-function", "sigmoid",
        "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "1e-2", "--moe-router-num-groups", "2",
        "--moe-router-group-topk", "1", "--moe-router-topk-scaling-factor", "2.5", "--moe-token-dispatcher-type",
        "alltoall", "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-3", "--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.3"],
    "noq": MLA + ["--rope-type", "rope", "--mtp-num-layers", "2"],
}
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
PP2 = ["--pipeline-model-parallel-size", "2"]
EP2 = ["--expert-model-parallel-size", "2"]
CP2 = ["--context-parallel-size", "2"]
# (name, world, variant, layout flags); each group of one world size runs in one pool call
LAYOUTS = [  # TP2+SP, CP2 (ring) and EP2 alone: covered by ep2_tp2_sp and cp2_tp2_sp below
    ("pp2", 2, "dsv3", PP2),
    ("pp2_interleaved", 2, "dsv3", PP2 + ["--num-layers-per-virtual-pipeline-stage", "1"]),
    # zero bubble: MLA's and the MTP layer's linears defer their weight gradients to W, the experts' do not
    ("pp2_zb_h1", 2, "dsv3", PP2 + ["--pipeline-schedule", "zb-h1"]),
    ("cp2_a2a", 2, "dsv3", CP2 + ["--cp-comm-type", "a2a"]),
    ("dp2_distopt", 2, "dsv3", ["--use-distributed-optimizer", "--overlap-grad-reduce"]),
    ("dp2_zero3", 2, "dsv3", ["--data-parallel-sharding-strategy", "optim_grads_params", "--overlap-grad-reduce",
                              "--overlap-param-gather"]),
    ("noq_tp2", 2, "noq", ["--tensor-model-parallel-size", "2"]),  # no SP: the rotary key's copy_to_tp
    ("noq_pp2_cp2", 4, "noq", PP2 + CP2),
    ("ep2_tp2_sp", 4, "dsv3", EP2 + TP2_SP),
    ("cp2_tp2_sp", 4, "dsv3", CP2 + TP2_SP),  # the router's token counts and MLA's rotary key over TP x CP
]
RECOMPUTE = [  # one process
    ("full_recompute", ["--recompute-granularity", "full", "--recompute-method", "uniform"]),
    ("selective_recompute", ["--recompute-granularity", "selective"]),
]
GROUP = 2  # runs per pool call (each call must finish within the harness's timeout, 300 s)


def _flags(variant, extra, save, iters=ITERS):
    return _argv(save, iters, VARIANTS[variant] + list(extra))


@pytest.fixture(scope="module")
def reference_runs(tmp_path_factory):
    """({variant: trajectory}, {variant: save folder}) of the single-process runs."""
    tmp = tmp_path_factory.mktemp("dsv3_ref")
    saves = {v: str(tmp / v) for v in VARIANTS}
    out = {v: run_script("pretrain_gpt", _flags(v, [], saves[v])) for v in VARIANTS}
    for v, traj in out.items():
        assert traj.losses[-1] < traj.losses[0], f"{v} did not train"
        assert all(set(r) == {"lm loss", *(f"mtp_{k} loss" for k in range(1, 3 if v == "noq" else 2))}
                   for r in traj.reported)
    return out, saves


@pytest.fixture(scope="module")
def reference(reference_runs):
    return reference_runs[0]


@pytest.fixture(scope="module")
def parallel_runs(tmp_path_factory):
    """({layout: trajectory}, {layout: save folder}) of the parallel runs (each saves at its last step)."""
    tmp = tmp_path_factory.mktemp("dsv3_par")
    out = {}
    for world in sorted({w for _, w, _, _ in LAYOUTS}):
        runs = [(name, _flags(v, extra, str(tmp / name))) for name, w, v, extra in LAYOUTS if w == world]
        for i in range(0, len(runs), GROUP):
            group = runs[i:i + GROUP]
            out.update(zip([n for n, _ in group], ranks_trajectories(world, "pretrain_gpt", [a for _, a in group])))
    return out, {name: str(tmp / name) for name, _, _, _ in LAYOUTS}


@pytest.fixture(scope="module")
def parallel(parallel_runs):
    return parallel_runs[0]


@pytest.mark.parametrize("name, variant", [(name, v) for name, _, v, _ in LAYOUTS])
def test_parallel_layout_reproduces_single_process(reference_runs, parallel_runs, name, variant):
    """The trajectory, then the final weights merged into the one-process layout: a wrong gradient
    too small for the gradient norm (MLA's shared rotary key not summed over TP) moves its tensor
    by ~lr per element under Adam."""
    assert_same_trajectory(parallel_runs[0][name], reference_runs[0][variant], steps=ITERS, what=name)
    # rtol 1e-5, atol 2e-6: the largest excess over rtol of a correct run is 7.1e-7 (noq_tp2's mtp eh_proj)
    assert_same_weights(parallel_runs[1][name], reference_runs[1][variant], what=name)


@pytest.mark.parametrize("name, extra", RECOMPUTE)
def test_recompute_reproduces_single_process(tmp_path, reference, name, extra):
    assert_same_trajectory(run_script("pretrain_gpt", _flags("dsv3", extra, str(tmp_path / name))),
                           reference["dsv3"], steps=ITERS, what=name)


def _joined(first: Trajectory, second: Trajectory) -> Trajectory:
    return Trajectory(first.losses + second.losses, first.grad_norms + second.grad_norms,
                      first.reported + second.reported)


def test_pp2_resume_is_bit_exact_and_converts_to_tp2(tmp_path, capsys, reference, parallel):
    """PP2 stopped at STOP and resumed continues bit for bit; its torch checkpoint, converted offline
    to TP2 (MoE: with SP), resumes there on the reference trajectory."""
    save, tp2 = str(tmp_path / "pp2"), str(tmp_path / "tp2")
    [first] = ranks_trajectories(2, "pretrain_gpt", [_flags("dsv3", PP2 + ["--exit-interval", str(STOP)], save)])
    assert load_tool("checkpoint/convert").main([
        "--model-type", "GPT", "--loader", "megatron", "--saver", "megatron", "--load-dir", save,
        "--save-dir", tp2, "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "1"]) == 0
    second, converted = ranks_trajectories(2, "pretrain_gpt", [
        _flags("dsv3", PP2 + ["--load", save], save),
        _flags("dsv3", TP2_SP + ["--load", tp2, "--no-load-rng"], str(tmp_path / "after"))])
    assert len(first) == STOP and _joined(first, second) == parallel["pp2"]
    assert_same_trajectory(_joined(first, converted), reference["dsv3"], steps=ITERS, what="converted PP2 -> TP2")
    # a DeepSeek-V3 export needs transformers' fixed latent-norm epsilon: one line, exit 2, nothing written
    capsys.readouterr()
    assert load_tool("checkpoint/convert").main(["--model-type", "GPT", "--saver", "hf", "--load-dir", save,
                                                 "--save-dir", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--norm-epsilon 1e-05 cannot be expressed in the deepseek_v3" in err, err
    assert not (tmp_path / "hf").exists()


def test_torch_dist_checkpoint_reshards_on_load(tmp_path, reference):
    """Saved at EP2 x TP2 + SP (torch_dist), loaded at PP2: the continuation follows the reference."""
    save = str(tmp_path / "dist")
    [first] = ranks_trajectories(4, "pretrain_gpt", [
        _flags("dsv3", EP2 + TP2_SP + ["--ckpt-format", "torch_dist", "--exit-interval", str(STOP)], save)])
    [second] = ranks_trajectories(2, "pretrain_gpt", [
        _flags("dsv3", PP2 + ["--ckpt-format", "torch_dist", "--load", save, "--no-load-rng"], str(tmp_path / "b"))])
    assert_same_trajectory(_joined(first, second), reference["dsv3"], steps=ITERS, what="torch_dist EP2xTP2 -> PP2")


def test_mtp_losses_in_console_and_tensorboard_evaluation_without_them(tmp_path, capsys):
    """``mtp_1 loss`` follows ``lm loss`` on the console line and is a TensorBoard scalar; the MTP
    layer's router logs as layer 4 (after the 4 decoder layers); evaluation reports no MTP loss."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = tmp_path / "tb"
    argv = _flags("dsv3", ["--tensorboard-dir", str(tb), "--moe-per-layer-logging", "--eval-iters", "1",
                           "--eval-interval", "3"], str(tmp_path / "s"), 3)
    run_script("pretrain_gpt", argv)
    out = capsys.readouterr().out
    line = [x for x in out.splitlines() if "iteration        2/" in x][0]
    assert line.index(" lm loss: ") < line.index(" mtp_1 loss: ") < line.index(" seq_load_balancing_loss: "), line
    validation = [x for x in out.splitlines() if "validation loss at" in x][0]
    assert "lm loss value" in validation and "mtp" not in validation, validation
    acc = EventAccumulator(str(next(tb.glob("events.*"))), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"lm loss", "mtp_1 loss", "moe/seq_load_balancing_loss_layer_4"} <= tags, tags
    assert "moe/seq_load_balancing_loss_layer_0" not in tags  # the dense first layer


@pytest.mark.parametrize("extra, words", [
    (["--rope-type", "yarn"], ("--rope-type yarn needs --position-embedding-type rope",)),
    (["--multi-latent-attention"], ("--position-embedding-type rope",)),
    (["--mtp-num-layers", "1"], ("--mtp-num-layers needs --position-embedding-type rope",)),
    (["--mtp-num-layers", "1", "--position-embedding-type", "rope", "--reset-attention-mask"],
     ("--mtp-num-layers with --reset-attention-mask is not built",)),
])
def test_combinations_not_built_exit_2_with_one_line(tmp_path, capsys, extra, words):
    _one_line_exit_2(capsys, _argv(str(tmp_path), 3, extra), *words)
