"""The optimizer wrapper against independent references.

* Global-norm clipping equals ``torch.nn.utils.clip_grad_norm_`` on the single-process model
  (returned norm and clipped grads; fp32 rtol 1e-5) for a TP=2 model (sharded and replicated
  params) and for a pipeline-like split over pp=2 with a tied embedding on both stages.
* fp16: an inf injected on one TP rank skips that step on every rank (params and Adam state
  bit-identical), the scale halves only after ``hysteresis`` overflows, skips are counted, and a
  clean step's grad norm equals the unscaled fp32 reference within fp16 accuracy (2e-3 relative).
* bf16 masters: training lowers the loss, masters stay fp32 and equal a plain fp32 AdamW stepped
  with the same gradients (rtol 1e-6: same fp32 arithmetic), and the bf16 params are the masters
  rounded to bf16 (within one bf16 ulp, 2^-8 relative, of the fp32 reference).
* state_dict round trip: k steps, save, load into fresh objects, continue == uninterrupted run
  (bit-identical params), for bf16 and fp16 (loss-scaler state included) with an LR schedule.
"""

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite.config import Config
from megatron_lite.optim import OptimizerParamScheduler, build_optimizer, clip_grad_norm
from megatron_lite.parallel.data_parallel import DistributedDataParallel, finalize_model_grads
from megatron_lite.parallel.state import ParallelState
from megatron_lite.parallel.tensor import ColumnParallelLinear, RowParallelLinear, normal_init, shard
from tests.harness import cached_state, run_ranks

IN, HID, OUT, B = 6, 8, 4, 5


def _gen(seed):
    return torch.Generator().manual_seed(seed)


class TPMLP(nn.Module):
    """Column (sharded weight+bias) -> GELU -> Row (sharded weight, replicated bias)."""

    def __init__(self, tp_group, dtype=torch.float32):
        super().__init__()
        self.fc1 = ColumnParallelLinear(IN, HID, tp_group, init_method=normal_init(0.5, _gen(1)), dtype=dtype)
        self.fc2 = RowParallelLinear(HID, OUT, tp_group, init_method=normal_init(0.5, _gen(2)), dtype=dtype)
        from megatron_lite.parallel.comm import group_rank, group_size

        with torch.no_grad():
            self.fc1.bias.copy_(shard(torch.randn(HID, generator=_gen(3)), 0, group_rank(tp_group), group_size(tp_group)))
            self.fc2.bias.copy_(torch.randn(OUT, generator=_gen(4)))

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def _data(step=0):
    g = _gen(100 + step)
    return torch.randn(B, IN, generator=g), torch.randn(B, OUT, generator=g)


def _loss(model, x, y):
    dtype = next(model.parameters()).dtype
    return ((model(x.to(dtype)).float() - y) ** 2).mean()


def _tp_shard(ref_tensor, param, state):
    if getattr(param, "tensor_model_parallel", False):
        return shard(ref_tensor, param.partition_dim, state.tp_rank, state.tp_size)
    return ref_tensor


# ---------------------------------------------------------------------------------------------
# clipping


def check_clip_tp(ratio):
    state = cached_state(tp=2)
    model = DistributedDataParallel(TPMLP(state.tp_group), state)
    ref = TPMLP(None)
    x, y = _data()
    _loss(model, x, y).backward()
    _loss(ref, x, y).backward()
    full_norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]).item()
    max_norm = ratio * full_norm
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm).item()
    norm = clip_grad_norm(model.parameters(), max_norm, state)
    assert norm == pytest.approx(ref_norm, rel=1e-5)
    for p, q in zip(model.module.parameters(), ref.parameters()):
        torch.testing.assert_close(p.main_grad, _tp_shard(q.grad, p, state), rtol=1e-5, atol=1e-7)
    return norm


def _pp_reference():
    """A 'two-stage' model: tied embedding E used at the input (stage 0) and output (stage 1)."""
    E = torch.randn(7, 3, generator=_gen(5))
    A = torch.randn(3, 3, generator=_gen(6))
    Bm = torch.randn(3, 3, generator=_gen(7))
    ids = torch.tensor([1, 4, 6, 2])
    target = torch.tensor([3, 0, 5, 1])
    return E, A, Bm, ids, target


def _pp_loss(E_in, A, Bm, E_out, ids, target):
    h = torch.tanh(E_in[ids] @ A)  # stage 0
    logits = (h @ Bm) @ E_out.t()  # stage 1
    return F.cross_entropy(logits, target)


class _Stage(nn.Module):
    def __init__(self, names_values):
        super().__init__()
        for name, value in names_values:
            self.register_parameter(name, nn.Parameter(value.clone()))


def check_clip_pp(ratio):
    state = cached_state(pp=2)
    E, A, Bm, ids, target = _pp_reference()
    # Reference: one E (its grad sums both uses); per-use grads from separate copies.
    params = [t.clone().requires_grad_() for t in (E, A, Bm)]
    _pp_loss(params[0], params[1], params[2], params[0], ids, target).backward()
    split = [t.clone().requires_grad_() for t in (E, A, Bm, E)]
    _pp_loss(*split, ids, target).backward()
    max_norm = ratio * torch.nn.utils.get_total_norm([p.grad for p in params]).item()
    ref_norm = torch.nn.utils.clip_grad_norm_(params, max_norm).item()

    if state.is_first_stage():
        stage = _Stage([("embedding", E), ("A", A)])
        local_grads = [split[0].grad, split[1].grad]  # E's input-side part only
        ref_grads = [params[0].grad, params[1].grad]
    else:
        stage = _Stage([("B", Bm), ("output", E)])
        local_grads = [split[2].grad, split[3].grad]
        ref_grads = [params[2].grad, params[0].grad]
    list(stage.parameters())[0 if state.is_first_stage() else 1].shared_embedding = True
    ddp = DistributedDataParallel(stage, state)
    for p, g in zip(stage.parameters(), local_grads):
        p.main_grad.copy_(g)
    finalize_model_grads([ddp], state)  # sums the two halves of E's grad over the embedding group
    norm = clip_grad_norm(stage.parameters(), max_norm, state)
    assert norm == pytest.approx(ref_norm, rel=1e-5)
    for p, g in zip(stage.parameters(), ref_grads):
        torch.testing.assert_close(p.main_grad, g, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("ratio", [0.3, 2.0])  # clipping active / inactive
def test_global_norm_clipping_tp2_matches_torch(ratio):
    norms = run_ranks(2, check_clip_tp, ratio)
    assert norms[0] == norms[1]


@pytest.mark.parametrize("ratio", [0.3, 2.0])
def test_global_norm_clipping_pipeline_split_counts_tied_embedding_once(ratio):
    run_ranks(2, check_clip_pp, ratio)


# ---------------------------------------------------------------------------------------------
# fp16 overflow handling


def _config(**precision):
    cfg = Config()
    cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.clip_grad = 1e-2, 0.1, 1.0
    for k, v in precision.items():
        setattr(cfg.precision, k, v)
    return cfg


def _snapshot(opt, model):
    params = [p.detach().clone() for p in model.parameters()]
    adam = [v.clone() for st in opt.optimizer.state.values() for v in st.values()]
    return params, adam


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a[0] + a[1], b[0] + b[1])) and len(a[1]) == len(b[1])


def check_fp16_skip():
    state = cached_state(tp=2)
    cfg = _config(fp16=True, initial_loss_scale=2.0**10, hysteresis=2, loss_scale_window=1000)
    model = DistributedDataParallel(TPMLP(state.tp_group, torch.float16), state)
    opt = build_optimizer(cfg, [model], state)
    ref = TPMLP(None)  # fp32 reference for the unscaled gradient norm

    def backward(step, inject):
        opt.zero_grad()
        x, y = _data(step)
        opt.scale_loss(_loss(model, x, y)).backward()
        finalize_model_grads([model], state)
        if inject and state.tp_rank == 1:
            model.module.fc1.weight.main_grad[0, 0] = float("inf")

    backward(0, False)
    ref_norm = torch.nn.utils.get_total_norm(torch.autograd.grad(_loss(ref, *_data(0)), list(ref.parameters()))).item()
    ok, norm = opt.step()
    assert ok and norm == pytest.approx(ref_norm, rel=2e-3)
    assert all(m.dtype == torch.float32 for m in opt.masters)
    scales, skipped = [], []
    for step, inject in [(1, True), (2, True), (3, False)]:
        before = _snapshot(opt, model)
        backward(step, inject)
        ok, norm = opt.step()
        assert ok is not inject and (norm is None) == inject
        assert _same(before, _snapshot(opt, model)) == inject  # skipped: nothing moved; else params moved
        scales.append(opt.get_loss_scale())
        skipped.append(opt.num_skipped_steps)
    assert scales == [2.0**10, 2.0**9, 2.0**9]  # hysteresis 2: the second overflow halves
    assert skipped == [1, 2, 2]


def test_fp16_overflow_on_one_tp_rank_skips_the_step_everywhere():
    run_ranks(2, check_fp16_skip)


# ---------------------------------------------------------------------------------------------
# master weights (single process)


def _plain_model(dtype):
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(IN, HID), nn.Tanh(), nn.Linear(HID, OUT), nn.LayerNorm(OUT)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_masters_match_fp32_adamw_on_same_grads(dtype):
    state = ParallelState()
    cfg = _config(bf16=dtype == torch.bfloat16)
    cfg.optim.clip_grad = 0.0  # compare the raw update
    model = DistributedDataParallel(_plain_model(dtype), state)
    opt = build_optimizer(cfg, [model], state)
    wd = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    assert [wd[id(m)] for m in opt.masters] == [0.0 if p.dim() == 1 else 0.1 for p in model.parameters()]
    ref_params = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    ref = torch.optim.AdamW(
        [{"params": [r for r, p in zip(ref_params, model.parameters()) if p.dim() > 1], "weight_decay": 0.1},
         {"params": [r for r, p in zip(ref_params, model.parameters()) if p.dim() == 1], "weight_decay": 0.0}],
        lr=1e-2, betas=(0.9, 0.999), eps=1e-8,
    )
    x, y = _data(0)
    losses = []
    for _ in range(25):
        opt.zero_grad()
        loss = _loss(model, x, y)
        loss.backward()
        finalize_model_grads([model], state)
        losses.append(loss.item())
        for r, p in zip(ref_params, model.parameters()):
            r.grad = p.main_grad.clone()
        assert opt.step()[0]
        ref.step()
    assert losses[-1] < 0.5 * losses[0]
    for p, m, r in zip(model.parameters(), opt.masters, ref_params):
        assert m.dtype == torch.float32 and p.dtype == dtype
        torch.testing.assert_close(m, r.detach(), rtol=1e-6, atol=1e-7)
        if dtype == torch.bfloat16:
            assert torch.equal(p, m.to(torch.bfloat16))
            torch.testing.assert_close(p.float(), r.detach(), rtol=2**-8, atol=1e-6)


def _train(model, opt, sched, state, steps, start):
    for step in range(start, start + steps):
        opt.zero_grad()
        x, y = _data(step)
        opt.scale_loss(_loss(model, x, y)).backward()
        finalize_model_grads([model], state)
        ok, _ = opt.step()
        if ok:
            sched.step()


@pytest.mark.parametrize("precision", [{"bf16": True}, {"fp16": True, "initial_loss_scale": 2.0**8, "loss_scale_window": 2}])
def test_state_dict_round_trip_continues_exactly(precision):
    state = ParallelState()
    cfg = _config(**precision)
    cfg.optim.lr_warmup_iters, cfg.optim.lr_decay_iters, cfg.optim.lr_decay_style = 2, 8, "cosine"
    dtype = torch.bfloat16 if precision.get("bf16") else torch.float16

    def build(seed):
        torch.manual_seed(seed)
        model = DistributedDataParallel(_plain_model(dtype), state)
        if seed != 3:  # a fresh run that starts from different weights
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
        opt = build_optimizer(cfg, [model], state)
        return model, opt, OptimizerParamScheduler(opt, cfg.optim, train_iters=8)

    full = build(3)
    _train(*full, state, 6, 0)
    part = build(3)
    _train(*part, state, 3, 0)
    buf = io.BytesIO()
    torch.save({"model": part[0].state_dict(), "opt": part[1].state_dict(), "sched": part[2].state_dict()}, buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=False)
    resumed = build(4)
    resumed[0].load_state_dict(sd["model"])
    resumed[1].load_state_dict(sd["opt"])
    resumed[2].load_state_dict(sd["sched"])
    assert resumed[1].get_loss_scale() == part[1].get_loss_scale()
    _train(*resumed, state, 3, 3)
    for a, b in zip(full[0].parameters(), resumed[0].parameters()):
        assert torch.equal(a, b)
    for a, b in zip(full[1].masters, resumed[1].masters):
        assert torch.equal(a, b)
    assert full[1].get_loss_scale() == resumed[1].get_loss_scale()
    assert full[2].get_lr() == resumed[2].get_lr()
    if precision.get("fp16"):
        assert full[1].get_loss_scale() == 2.0**11  # grew every 2 clean steps, so its state mattered
