"""pretrain_gpt.py with mixture-of-experts layers: expert-parallel runs reproduce the single-process run.

Same pattern as test_pretrain_gpt.py: ``pretrain_gpt.main(argv)`` on every rank of a gloo pool vs in
this process; same seed and global batch, dropout 0, fp32; every step's loss and gradient norm
(which carries the router losses' gradients from step 1 on) within a relative 1e-5. A Mixtral-like
model: SwiGLU experts, RMSNorm, rope, GQA, top-2 of 4 experts with load-balancing and z-losses;
expert, tensor, data, pipeline and context parallelism (EP1 and EP2, both dispatchers).
"""

import glob
import math
import os

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import pretrain_gpt
from megatron_lite.checkpoint import load_gpt_checkpoint
from tests.e2e.test_pretrain_gpt import MODEL, _argv, _one_line_exit_2, _parallel, _same_weights, _single
from tests.harness import run_ranks
from tests.tools import load_tool
from tests.trajectory import Trajectory, assert_same_trajectory, ranks_trajectories, ranks_trajectory

MOE = [
    "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
    "--ffn-hidden-size", "128",  # 4h, the experts' width too: Megatron's SwiGLU default (64) learns too little in ITERS steps
    "--group-query-attention", "--num-query-groups", "2", "--num-experts", "4", "--moe-router-topk", "2",
    "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3", "--moe-token-dispatcher-type", "alltoall",
]
# every other layer dense, capacity dropping, shared experts, grouped GEMM, sigmoid router with expert bias
MOE_B = ["--moe-layer-freq", "([1,0]*2)", "--moe-expert-capacity-factor", "1.0",
         "--moe-shared-expert-intermediate-size", "32", "--moe-grouped-gemm", "--moe-router-score-function",
         "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "1e-2"]
ITERS = 5  # the fewest after which every reference's loss is below its first (the 4th is above it)
CP2 = ["--context-parallel-size", "2"]
PER_TOKEN = ["--calculate-per-token-loss"]  # routers' losses x the micro-batch's tokens, with the loss scale alone


@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe_ref")
    return {variant: _single(tmp, f"single{variant}", ITERS, MOE + extra)
            for variant, extra in (("A", []), ("B", MOE_B), ("P", PER_TOKEN))}


@pytest.mark.parametrize(
    "name, world, variant, extra",
    [
        ("ep2", 2, "A", ["--expert-model-parallel-size", "2"]),
        ("ep4", 4, "A", ["--expert-model-parallel-size", "4"]),
        ("ep2_tp2_sp", 4, "A", ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                                "--sequence-parallel"]),
        ("ep2_tp2_sp_etp1", 4, "A", ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                                     "--sequence-parallel", "--expert-tensor-parallel-size", "1"]),
        # parallel folding: the experts re-cut the 4 ranks as ETP x EP x expert-DP; TP 1 (DP 4) with every
        # expert split over ETP 2 x EP 2 (TP 2 with ETP 1 x EP 4: test_folded_torch_checkpoint_resumes)
        ("etp2_ep2_dp4", 4, "A", ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2"]),
        ("ep2_dp2_distopt", 4, "A", ["--expert-model-parallel-size", "2", "--use-distributed-optimizer",
                                     "--overlap-grad-reduce", "--overlap-param-gather"]),
        # hybrid sharding: dense state over 2 of the 4 DP ranks, expert state over 1 of the 2 expert-DP
        # ranks, each all-reduced across the 2 instances (small overlapped buckets: several of each kind)
        ("ep2_dp4_hybrid", 4, "A", ["--expert-model-parallel-size", "2", "--use-distributed-optimizer",
                                    "--num-distributed-optimizer-instances", "2", "--overlap-grad-reduce",
                                    "--overlap-param-gather", "--ddp-bucket-size", "3000"]),
        # DP 2 x CP 2 / EP 2: the expert-DP x CP group is one CP pair, so its instances split CP
        # (the expert blocks are not inside the dense blocks: still one sum over all ranks)
        ("ep2_cp2_hybrid", 4, "A", CP2 + ["--expert-model-parallel-size", "2", "--use-distributed-optimizer",
                                          "--num-distributed-optimizer-instances", "2"]),
        ("ep2_pp2", 4, "B", ["--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
        ("ep2_per_token", 2, "P", ["--expert-model-parallel-size", "2"]),
        # per token, each TP rank attaches its partial router losses times T_local x TP (the full micro-batch's tokens)
        ("tp2_sp_per_token", 2, "P", ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
        ("ep2_recompute", 2, "A", ["--expert-model-parallel-size", "2", "--recompute-granularity", "full",
                                   "--recompute-method", "uniform"]),
        ("ep2_pp2_vpp", 4, "B", ["--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                 "--num-layers-per-virtual-pipeline-stage", "1"]),
        # zero bubble: the dense linears' weight gradients deferred to W, the grouped experts' computed in B
        ("ep2_pp2_zb_h1", 4, "B", ["--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                   "--pipeline-schedule", "zb-h1"]),
        ("ep2_pp2_vpp_zb", 4, "B", ["--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                    "--num-layers-per-virtual-pipeline-stage", "1", "--pipeline-schedule", "zb-h1"]),
        # CP: each CP rank routes its half of every sequence, so the load-balancing loss's token counts
        # and the z-loss's normaliser span TP x CP; expert gradients are averaged over expert-DP x CP.
        # Variant A: no capacity (under CP each rank would drop within its own half)
        ("ep1_cp2", 2, "A", CP2),
        ("ep1_cp2_allgather", 2, "A", CP2 + ["--moe-token-dispatcher-type", "allgather"]),
        ("ep2_cp2", 4, "A", CP2 + ["--expert-model-parallel-size", "2"]),
        ("ep2_cp2_allgather", 4, "A", CP2 + ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type",
                                             "allgather"]),
        # ZeRO-3: expert parameters sharded over the expert-data-parallel group, dense over all 4 ranks
        ("ep2_dp2_zero3", 4, "B", ["--expert-model-parallel-size", "2", "--data-parallel-sharding-strategy",
                                   "optim_grads_params", "--overlap-grad-reduce", "--overlap-param-gather"]),
    ],
)
def test_moe_runs_reproduce_single_process(tmp_path, moe_reference, name, world, variant, extra):
    ref, ref_save = moe_reference[variant]
    variant_flags = {"A": [], "B": MOE_B, "P": PER_TOKEN}[variant]
    got, save = _parallel(tmp_path, name, world, ITERS, MOE + variant_flags + extra)
    assert_same_trajectory(got, ref, steps=ITERS)
    assert ref.losses[-1] < ref.losses[0]  # it trained
    _same_weights(save, ref_save)  # experts of every EP rank merged back into one process


def test_global_aux_loss_at_tp2_sp_cp2_and_interleaved_pp2_reproduces_one_process(tmp_path):
    """The global load-balancing loss counts the step's micro-batches so far over TP x CP x DP: TP + SP
    and CP split each micro-batch's tokens (their counts summed back), PP routes whole micro-batches in
    the same order, interleaved or not, so each reproduces one process (DP does not: the running
    count then holds both ranks' micro-batches; docs/mixture-of-experts.md)."""
    flags = MOE + ["--moe-router-load-balancing-type", "global_aux_loss", "--moe-aux-loss-coeff", "1e-1"]
    ref, _ = _single(tmp_path, "single", ITERS, flags)
    layouts = {"tp2_sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"], "cp2": CP2,
               "pp2_vpp": ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]}
    # DP2 in the same pool call; its first gradient norm is all it needs (3 steps: the fewest with 2 warm-up steps)
    *runs, dp2 = ranks_trajectories(2, "pretrain_gpt", [_argv(str(tmp_path / n), ITERS, flags + f)
                                                        for n, f in layouts.items()] + [_argv(str(tmp_path / "dp2"), 3, flags)])
    for name, got in zip(layouts, runs, strict=True):
        assert_same_trajectory(got, ref, what=name)
    assert dp2.grad_norms[0] != pytest.approx(ref.grad_norms[0], rel=1e-5)  # DP changes the running count


@pytest.mark.parametrize("extra, words", [
    (["--num-experts", "3", "--moe-router-num-groups", "2", "--moe-router-group-topk", "1"],
     ("--num-experts 3", "--moe-router-num-groups")),
    (["--num-experts", "4", "--moe-router-topk", "5"], ("--moe-router-topk",)),
    (["--num-experts", "4", "--moe-router-topk", "1"], ("--moe-router-pre-softmax",)),
    (["--num-experts", "4", "--moe-router-load-balancing-type", "sinkhorn", "--moe-expert-capacity-factor", "1"],
     ("--moe-expert-capacity-factor",)),
    (["--num-experts", "4", "--moe-permute-fusion"], ("--moe-permute-fusion",)),
    (["--num-experts", "4", "--expert-model-parallel-size", "2"], ("expert-model-parallel-size 2",)),  # world 1
    (["--num-experts", "4", "--tensor-model-parallel-size", "1", "--moe-token-dispatcher-type", "flex"], ("flex",)),
    # parallel folding: ETP x EP must divide a stage's ranks (world 1 here); ETP must divide the expert width
    (["--num-experts", "4", "--expert-tensor-parallel-size", "2"],
     ("--expert-tensor-parallel-size 2 x --expert-model-parallel-size 1",)),
    (["--num-experts", "4", "--moe-ffn-hidden-size", "6", "--expert-tensor-parallel-size", "4"],
     ("--moe-ffn-hidden-size 6", "--expert-tensor-parallel-size 4")),
])
def test_bad_moe_combinations_exit_2(tmp_path, capsys, extra, words):
    argv = MODEL + ["--micro-batch-size", "2", "--train-iters", "1", "--save", str(tmp_path)] + extra
    _one_line_exit_2(capsys, argv, *words)


def _run_cli_result(argv):
    """Inside a rank: (trajectory, iteration, exit reason)."""
    result = pretrain_gpt.main(argv)
    return Trajectory.of(result), result.iteration, result.exit_reason


def test_ep2_resume_continues_the_trajectory(tmp_path, moe_reference):
    """Expert weights are saved per EP rank (its own folder) with the expert bias; a resumed EP2 run
    gives bit-identically the losses of an uninterrupted EP2 run (which follow the single process)."""
    save = str(tmp_path / "resumed")
    flags = MOE + MOE_B + ["--expert-model-parallel-size", "2"]
    first = run_ranks(2, _run_cli_result, _argv(save, ITERS, flags + ["--exit-interval", str(ITERS // 2)]))
    assert all(r[1] == ITERS // 2 and r[2] == "interval" for r in first)
    folders = sorted(os.path.basename(os.path.dirname(f))
                     for f in glob.glob(os.path.join(save, f"iter_{ITERS // 2:07d}", "mp_rank_*", "*.pt")))
    assert folders == ["mp_rank_00_000_000", "mp_rank_00_000_001"], folders
    second = run_ranks(2, _run_cli_result, _argv(save, ITERS, flags + ["--load", save]))
    assert all(r[1] == ITERS for r in second)
    straight = run_ranks(2, _run_cli_result, _argv(str(tmp_path / "straight"), ITERS, flags))
    assert_same_trajectory(first[0][0] + second[0][0], straight[0][0], rtol=0)  # bit-identical continuation
    assert_same_trajectory(straight[0][0], moe_reference["B"][0], steps=ITERS)


def test_ep2_bf16_trains(tmp_path):
    argv = _argv(str(tmp_path / "bf16"), 6, MOE + ["--expert-model-parallel-size", "2", "--bf16", "--moe-grouped-gemm"])
    losses = run_ranks(2, _run_cli_result, argv)[0][0].losses
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses


def test_router_losses_in_console_and_tensorboard(tmp_path, capsys):
    """The console line carries the router losses right after lm loss; TensorBoard gets them, per
    layer with --moe-per-layer-logging, and the dropped-token count with a capacity factor."""
    tb = tmp_path / "tb"
    argv = _argv(str(tmp_path / "ckpt"), 3, MOE + ["--moe-layer-freq", "([0,1]*2)", "--moe-per-layer-logging",
                                                  "--moe-expert-capacity-factor", "0.5", "--tensorboard-dir", str(tb)])
    pretrain_gpt.main(argv)
    line = [x for x in capsys.readouterr().out.splitlines() if "iteration        2/" in x][0]
    assert " lm loss: " in line and line.index(" lm loss: ") < line.index(" load_balancing_loss: ") \
        < line.index(" z_loss: ") < line.index(" loss scale: "), line
    balance = float(line.split(" load_balancing_loss: ")[1].split(" |")[0])
    assert 0.9 < balance < 2.0, balance
    files = glob.glob(str(tb / "events.*"))
    acc = EventAccumulator(files[0], size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    expected = {"load_balancing_loss", "z_loss", "moe/load_balancing_loss_layer_1", "moe/load_balancing_loss_layer_3",
                "moe/z_loss_layer_1", "moe/z_loss_layer_3", "moe/dropped_tokens"}
    assert expected <= tags and "moe/z_loss_layer_0" not in tags, tags
    assert acc.Scalars("moe/dropped_tokens")[0].value > 0  # capacity 0.5 must drop


def test_ep_checkpoint_loads_into_one_process(moe_reference, tmp_path):
    """An EP2 x TP2 checkpoint merges into a single-process MoE GPT (what tools/generate.py loads)."""
    save = _parallel(tmp_path, "ep2tp2", 4, 3, MOE + MOE_B + ["--expert-model-parallel-size", "2",
                                                             "--tensor-model-parallel-size", "2", "--sequence-parallel"])[1]
    model, saved = load_gpt_checkpoint(save)
    assert saved["num_experts"] == 4 and model.config.num_experts == 4
    experts = model.decoder.layers[0].mlp.experts
    assert experts.weight1.shape[0] == 4 and experts.num_local_experts == 4


def test_hybrid_sharded_torch_checkpoint_resumes_with_one_instance(tmp_path, moe_reference):
    """--ckpt-format torch gathers the expert optimizer state inside one instance: a checkpoint saved
    at EP2 x DP4 with two instances resumes with one (DP4, and DP2 where expert-DP is 1) on the
    single-process trajectory, and with two instances again bit-identically to the uninterrupted run."""
    save = str(tmp_path / "hybrid")
    distopt = MOE + ["--expert-model-parallel-size", "2", "--use-distributed-optimizer"]
    hybrid = distopt + ["--num-distributed-optimizer-instances", "2"]
    first = ranks_trajectory(4, "pretrain_gpt", _argv(save, ITERS, hybrid + ["--exit-interval", str(ITERS // 2)]))
    dp4, again = ranks_trajectories(4, "pretrain_gpt", [
        _argv(str(tmp_path / "dp4"), ITERS, distopt + ["--load", save]),
        _argv(str(tmp_path / "again"), ITERS, hybrid + ["--load", save])])
    dp2 = ranks_trajectory(2, "pretrain_gpt", _argv(str(tmp_path / "dp2"), ITERS, distopt + ["--load", save]))
    straight = ranks_trajectory(4, "pretrain_gpt", _argv(str(tmp_path / "straight"), ITERS, hybrid))
    for name, second in (("one instance DP4", dp4), ("one instance DP2", dp2)):
        assert_same_trajectory(first + second, moe_reference["A"][0], steps=ITERS, what=name)
    assert_same_trajectory(first + again, straight, rtol=0)  # bit-identical continuation


def test_folded_torch_checkpoint_resumes(tmp_path, moe_reference):
    """Parallel folding, TP 2 attention with whole experts over ETP 1 x EP 4 (each rank one of the 4
    experts) and the distributed optimizer: the single-process trajectory, through a --ckpt-format torch
    save (one mp_rank_TT_PPP_EEE_XX folder per dense x expert shard pair) and a resume at the same
    sizes; the final folded files merge into the one-process weights. tools/checkpoint/convert.py
    writes the half-way checkpoint at TP 1 with every expert split over ETP 2 x EP 2 (weights, Adam
    moments, schedule), which resumes on the same trajectory (rel 1e-5, --no-load-rng)."""
    save = str(tmp_path / "folded")
    flags = MOE + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size", "4",
                   "--expert-tensor-parallel-size", "1", "--use-distributed-optimizer"]
    first = ranks_trajectory(4, "pretrain_gpt", _argv(save, ITERS, flags + ["--exit-interval", str(ITERS // 2)]))
    folders = sorted(os.listdir(os.path.join(save, f"iter_{ITERS // 2:07d}")))
    assert folders == ["mp_rank_00_000_000_00", "mp_rank_00_000_002_00", "mp_rank_01_000_001_00",
                       "mp_rank_01_000_003_00", "rng"], folders
    etp2 = str(tmp_path / "etp2")
    assert load_tool("checkpoint/convert").main(["--model-type", "GPT", "--load-dir", save, "--save-dir", etp2,
                                                 "--target-tensor-parallel-size", "1", "--target-expert-parallel-size",
                                                 "2", "--target-expert-tensor-parallel-size", "2"]) == 0
    second, converted = ranks_trajectories(4, "pretrain_gpt", [
        _argv(save, ITERS, flags + ["--load", save]),
        _argv(str(tmp_path / "b"), ITERS, MOE + ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size",
                                                 "2", "--use-distributed-optimizer", "--load", etp2, "--no-load-rng"])])
    assert_same_trajectory(first + second, moe_reference["A"][0], steps=ITERS)
    assert_same_trajectory(first + converted, moe_reference["A"][0], steps=ITERS, what="converted to ETP 2 x EP 2")
    _same_weights(save, moe_reference["A"][1])


def test_folded_etp2_checkpoint_resumes_at_etp1(tmp_path, moe_reference):
    """Parallel folding: a torch_dist checkpoint saved with TP 1 attention and the experts split over
    ETP 2 x EP 2 resumes with TP 2 attention and whole experts over ETP 1 x EP 4 on the
    single-process trajectory: the boxes are global, so dense weights reshard across TP and expert
    weights across ETP and EP."""
    save = str(tmp_path / "etp2")
    flags = MOE + ["--ckpt-format", "torch_dist"]
    etp2 = flags + ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2"]
    etp1 = flags + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size", "4",
                    "--expert-tensor-parallel-size", "1"]
    first = ranks_trajectory(4, "pretrain_gpt", _argv(save, ITERS, etp2 + ["--exit-interval", str(ITERS // 2)]))
    second = ranks_trajectory(4, "pretrain_gpt", _argv(str(tmp_path / "etp1"), ITERS, etp1 + [
        "--load", save, "--no-load-rng"]))  # (RNG states are per rank)
    assert_same_trajectory(first + second, moe_reference["A"][0], steps=ITERS)


def test_expert_parallelism_across_context_parallel_ranks(tmp_path, moe_reference):
    """EP spans CP as in Megatron-LM (the experts' grid is cut from the stage's TP x CP x DP ranks):
    EP 4 at CP 2 x DP 2 (the distributed optimizer, torch_dist), stopped half-way and resumed at CP 4 x
    DP 1 with EP 4, follows the single-process trajectory, and its final weights merge into the
    one-process ones."""
    save = str(tmp_path / "cp2_dp2")
    flags = MOE + ["--ckpt-format", "torch_dist", "--use-distributed-optimizer", "--expert-model-parallel-size", "4"]
    first = ranks_trajectory(4, "pretrain_gpt", _argv(save, ITERS, flags + CP2 + ["--exit-interval", str(ITERS // 2)]))
    resumed = str(tmp_path / "cp4")
    second = ranks_trajectory(4, "pretrain_gpt", _argv(resumed, ITERS, flags + [
        "--context-parallel-size", "4", "--load", save, "--no-load-rng"]))
    assert_same_trajectory(first + second, moe_reference["A"][0], steps=ITERS)
    _same_weights(resumed, moe_reference["A"][1])


def test_whole_and_split_experts_reshard_through_torch_dist(tmp_path, moe_reference):
    """torch_dist saves the experts whole (--expert-tensor-parallel-size 1 on an unfolded grid) or split
    over an expert-tensor group (the default, and every folded grid, even of one rank): two canonical
    forms of the same tensors, which the loader reshapes into each other. A folded TP 2 with ETP 1 x EP 4
    checkpoint (distributed optimizer) resumes unfolded at TP 2 with whole experts over EP 2, and an
    unfolded one-process checkpoint with whole experts resumes without the flag, both on the
    single-process trajectory (it refused both: 'has shape (64, 32) (canonical), this model needs
    (2, 32, 32); match the model flags')."""
    flags = MOE + ["--ckpt-format", "torch_dist", "--use-distributed-optimizer"]
    whole_tp2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1"]
    folded, unfolded = (str(tmp_path / n) for n in ("folded", "unfolded"))
    half = ["--exit-interval", str(ITERS // 2)]
    first = ranks_trajectory(4, "pretrain_gpt", _argv(folded, ITERS, flags + whole_tp2 + [
        "--expert-model-parallel-size", "4"] + half))
    second = ranks_trajectory(4, "pretrain_gpt", _argv(str(tmp_path / "a"), ITERS, flags + whole_tp2 + [
        "--expert-model-parallel-size", "2", "--load", folded, "--no-load-rng"]))
    assert_same_trajectory(first + second, moe_reference["A"][0], steps=ITERS, what="folded -> unfolded whole")
    first = Trajectory.of(pretrain_gpt.main(_argv(unfolded, ITERS, flags + ["--expert-tensor-parallel-size", "1"]
                                                  + half)))
    second = Trajectory.of(pretrain_gpt.main(_argv(str(tmp_path / "b"), ITERS, flags + ["--load", unfolded])))
    assert_same_trajectory(first + second, moe_reference["A"][0], steps=ITERS, what="whole -> split, one process")
