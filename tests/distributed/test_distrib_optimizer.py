"""--use-distributed-optimizer against the plain optimizer on the same ranks and data.

On 4 ranks (dp 4, or tp 2 x dp 2) each rank trains two copies of the same TP model, one with
MegatronOptimizer (all-reduced grads, full state) and one with DistributedOptimizer (reduce-
scattered grads, state sharded over DP, all-gathered params), with tiny buckets so parameters
straddle shard boundaries, clipping active, and (tp 2) the reduction overlapped with backward. After every step the grad norms agree (rel 1e-5)
and so do the params (fp32: rtol 1e-5; bf16/fp16: the fp32 masters rtol 1e-5, the 16-bit params
within one ulp, 2^-7 relative). Both also follow the single-process run of the full model (grad norms
and params; fp32 rel 1e-5, 16-bit within the stated tolerances below). state_dict() of the sharded
optimizer equals the plain one's (same format), and a plain checkpoint loaded into a fresh sharded
optimizer continues like the original.
"""

import pytest
import torch

from megatron_lite.config import Config
from megatron_lite.optim import build_optimizer
from megatron_lite.optim.distrib_optimizer import DistributedOptimizer
from megatron_lite.parallel.data_parallel import DistributedDataParallel, finalize_model_grads
from megatron_lite.parallel.state import ParallelState
from tests.distributed.test_optimizer import TPMLP, _data, _loss, _tp_shard
from tests.harness import cached_state, run_ranks

# Against the single-process run (the full model; one loss, the mean over every DP rank's batch):
# fp32 at the usual 1e-5 (measured: norms 1e-7, params 3e-8). In 16-bit the gradients are
# summed in another order in bf16/fp16 (the DP ranks' batches in one backward, the TP split's
# partial products), so they differ by the dtype's rounding (2^-8 relative for bf16, 2^-11 for
# fp16): the norm within NORM_RTOL (measured: 2e-3 bf16, 1.3e-4 fp16) and the parameters, after
# Adam normalised those gradients, within SINGLE_TOL (measured: 1e-3 absolute bf16, 2.4e-4 fp16).
NORM_RTOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-3}
SINGLE_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2**-7, atol=1e-4),
              torch.float16: dict(rtol=2**-7, atol=1e-4)}


def _cfg(dtype, distributed):
    cfg = Config()
    cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.clip_grad = 1e-2, 0.1, 0.5
    cfg.precision.bf16 = dtype == torch.bfloat16
    cfg.precision.fp16 = dtype == torch.float16
    cfg.precision.initial_loss_scale = 2.0**8
    cfg.parallel.use_distributed_optimizer = distributed
    return cfg


def _build(state, dtype, distributed):
    overlap = state.tp_size == 2  # also reduce-scatter asynchronously during backward
    model = DistributedDataParallel(TPMLP(state.tp_group, dtype), state, bucket_size=7, overlap_grad_reduce=overlap)
    return model, build_optimizer(_cfg(dtype, distributed), [model], state)


def _step(model, opt, state, step):
    opt.zero_grad()
    opt.scale_loss(_loss(model, *_data(10 * step + state.dp_rank))).backward()
    finalize_model_grads([model], state)
    return opt.step()


class _SingleProcess:
    """The same training in one process: the full model (TP 1), each step's loss the mean over every
    data-parallel rank's batch (what DP's gradient average computes)."""

    def __init__(self, dtype, dp):
        self.state, self.dp = ParallelState(world_size=1, rank=0), dp
        self.model, self.opt = _build(self.state, dtype, False)

    def step(self, step):
        self.opt.zero_grad()
        loss = sum(_loss(self.model, *_data(10 * step + d)) for d in range(self.dp)) / self.dp
        self.opt.scale_loss(loss).backward()
        finalize_model_grads([self.model], self.state)
        return self.opt.step()


def _close_to_single(model, single, state, dtype):
    """This rank's parameters against its TP slices of the single-process ones."""
    for p, q in zip(model.parameters(), single.model.parameters()):
        torch.testing.assert_close(p.float(), _tp_shard(q, p, state).float(), **SINGLE_TOL[dtype])


def _close_params(a, b, dtype):
    for p, q in zip(a.parameters(), b.parameters()):
        if dtype == torch.float32:
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        else:
            torch.testing.assert_close(p.float(), q.float(), rtol=2**-7, atol=1e-4)


def _close_sd(a, b):
    for x, y in zip(a["fp32_masters"], b["fp32_masters"]):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    assert a["optimizer"]["state"].keys() == b["optimizer"]["state"].keys()
    for i, entry in a["optimizer"]["state"].items():
        for k, v in entry.items():
            torch.testing.assert_close(v.float(), b["optimizer"]["state"][i][k].float(), rtol=1e-4, atol=1e-7)
    assert [g["params"] for g in a["optimizer"]["param_groups"]] == [g["params"] for g in b["optimizer"]["param_groups"]]


def check_equal_to_plain(tp, dtype):
    state = cached_state(tp=tp)
    plain_model, plain = _build(state, dtype, False)
    dist_model, dist_opt = _build(state, dtype, True)
    assert isinstance(dist_opt, DistributedOptimizer) and not isinstance(plain, DistributedOptimizer)
    owned = sum(m.numel() for m in dist_opt.masters)
    assert owned < sum(p.numel() for p in plain_model.parameters())  # state really is sharded
    single = _SingleProcess(dtype, state.dp_size)
    for step in range(4):
        ok_a, norm_a = _step(plain_model, plain, state, step)
        ok_b, norm_b = _step(dist_model, dist_opt, state, step)
        ok_s, norm_s = single.step(step)
        assert ok_a and ok_b and ok_s and norm_b == pytest.approx(norm_a, rel=1e-5)
        assert norm_b == pytest.approx(norm_s, rel=NORM_RTOL[dtype]), f"step {step + 1}: {norm_b} vs single {norm_s}"
        _close_params(plain_model, dist_model, dtype)
        _close_to_single(dist_model, single, state, dtype)
    sd_plain, sd_dist = plain.state_dict(), dist_opt.state_dict()
    if dtype == torch.float32:
        sd_plain = dict(sd_plain, fp32_masters=[p.detach() for p in plain_model.parameters()])
    _close_sd(sd_plain, sd_dist)
    fresh_model, fresh = _build(state, dtype, False)  # the sharded checkpoint loads into the plain optimizer
    fresh.load_state_dict(sd_dist)
    _close_params(fresh_model, dist_model, dtype)
    assert fresh.optimizer.state_dict()["state"].keys() == sd_plain["optimizer"]["state"].keys()

    # resume the plain checkpoint with a fresh sharded optimizer (and model weights from the plain run)
    resumed_model, resumed = _build(state, dtype, True)
    resumed_model.load_state_dict(plain_model.state_dict())
    resumed.load_state_dict(plain.state_dict())
    for step in range(4, 6):
        ok_a, norm_a = _step(plain_model, plain, state, step)
        ok_b, norm_b = _step(resumed_model, resumed, state, step)
        assert norm_b == pytest.approx(norm_a, rel=1e-5)
    _close_params(plain_model, resumed_model, dtype)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_distributed_optimizer_equals_plain(tp, dtype):
    run_ranks(4, check_equal_to_plain, tp, dtype)


def check_overflow_on_one_rank_skips_the_step_everywhere():
    """An inf that reaches only DP rank 0's chunk (after the reduce-scatter only the owner sees it)
    must make every rank skip the step: the found-inf flag is MAX-reduced over the DP group too."""
    state = cached_state(tp=1)
    model, opt = _build(state, torch.float16, True)
    opt.zero_grad()
    opt.scale_loss(_loss(model, *_data(state.dp_rank))).backward()
    finalize_model_grads([model], state)
    if state.dp_rank == 0:
        opt.pieces[0].grad().view(-1)[0] = float("inf")
    before = [p.detach().clone() for p in model.parameters()]
    # no collective after the skip decision: a rank that wrongly steps fails here instead of hanging
    opt._grad_norm, opt._gather_params = lambda: 1.0, lambda: None
    ok, norm = opt.step()
    assert (ok, norm) == (False, None), f"DP rank {state.dp_rank} stepped although DP rank 0 overflowed"
    assert opt.num_skipped_steps == 1
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p, q)


def test_an_overflow_seen_by_one_data_parallel_rank_skips_the_step_on_all():
    run_ranks(4, check_overflow_on_one_rank_skips_the_step_everywhere)


def _aware(cfg):
    """``cfg`` with --use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16."""
    cfg.precision.use_precision_aware_optimizer = True
    cfg.precision.exp_avg_dtype = cfg.precision.exp_avg_sq_dtype = "bf16"
    return cfg


def _build_aware(state, aware=True, offload=0.0):
    model = DistributedDataParallel(TPMLP(state.tp_group, torch.float32), state, bucket_size=7)
    cfg = _cfg(torch.float32, True)
    cfg.optim.optimizer_cpu_offload, cfg.optim.optimizer_offload_fraction = offload > 0, offload
    return model, build_optimizer(_aware(cfg) if aware else cfg, [model], state)


def _moment_bytes(opt) -> int:
    return sum(v.nbytes for s in opt.optimizer.state.values() for k, v in s.items() if k.startswith("exp_avg"))


def check_precision_aware_dp2():
    """DP2 with bf16 moments (and half of them offloaded to the CPU) follows one process with bf16
    moments; the moments' live bytes are half of fp32 Adam's; a checkpoint resumes bit for bit, and
    fp32 and bf16 moment checkpoints load into each other's runs (cast)."""
    from megatron_lite.perf.model_state import measured_model_state_bytes

    state = cached_state(tp=1)
    model, opt = _build_aware(state)
    offload_model, offload_opt = _build_aware(state, offload=0.5)
    fp32_model, fp32_opt = _build_aware(state, aware=False)
    single = _SingleProcess(torch.float32, state.dp_size)
    single.model, single.opt = _build_aware(single.state)
    for step in range(4):
        (ok, norm), (_, norm_o), (_, norm_s) = (_step(model, opt, state, step),
                                                _step(offload_model, offload_opt, state, step), single.step(step))
        _step(fp32_model, fp32_opt, state, step)
        assert ok and norm == pytest.approx(norm_s, rel=1e-5) and norm_o == pytest.approx(norm, rel=1e-6)
        _close_to_single(model, single, state, torch.float32)
        _close_params(model, offload_model, torch.float32)
    assert {v.dtype for s in opt.optimizer.state.values() for k, v in s.items() if k != "step"} == {torch.bfloat16}
    assert 2 * _moment_bytes(opt) == _moment_bytes(fp32_opt) > 0
    measured, measured_fp32 = (measured_model_state_bytes([m], o)["optimizer"] for m, o in ((model, opt), (fp32_model, fp32_opt)))
    assert measured_fp32 - measured == _moment_bytes(opt)  # the masters unchanged, the moments halved

    sd = opt.state_dict()  # torch format: the moments saved in bf16
    assert {v.dtype for e in sd["optimizer"]["state"].values() for k, v in e.items() if k != "step"} == {torch.bfloat16}
    resumed_model, resumed = _build_aware(state)
    resumed_model.load_state_dict(model.state_dict())
    resumed.load_state_dict(sd)
    cast_model, cast = _build_aware(state)  # an fp32-moment checkpoint into a bf16-moment run
    cast_model.load_state_dict(fp32_model.state_dict())
    cast.load_state_dict(fp32_opt.state_dict())
    back_model, back = _build_aware(state, aware=False)  # and the reverse
    back_model.load_state_dict(model.state_dict())
    back.load_state_dict(sd)
    for (_, o), (_, of) in (((cast_model, cast), (fp32_model, fp32_opt)), ((back_model, back), (model, opt))):
        for piece, theirs in zip(o.pieces, of.pieces):
            for key in ("exp_avg", "exp_avg_sq"):
                mine, saved = o.optimizer.state[piece.master][key], of.optimizer.state[theirs.master][key]
                assert mine.dtype == (torch.float32 if o is back else torch.bfloat16), mine.dtype  # cast on load
                assert torch.equal(mine, saved.to(mine.dtype))
    for step in range(4, 6):
        _step(model, opt, state, step)
        _step(resumed_model, resumed, state, step)
        for p, q in zip(model.parameters(), resumed_model.parameters()):
            assert torch.equal(p, q), f"resumed step {step + 1}"


def test_precision_aware_optimizer_dp2_equals_one_process():
    run_ranks(2, check_precision_aware_dp2)
