"""Checkpoints on 2 ranks with tensor parallelism: per-rank files, a resumed run continues exactly
(weights, Adam state, per-rank dropout streams), and a TP-size change is refused with one message."""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_lite.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from megatron_lite.config import Config
from megatron_lite.parallel.random import model_parallel_seed
from megatron_lite.parallel.tensor import ColumnParallelLinear, RowParallelLinear
from tests.harness import cached_state, run_ranks


class TPBlock(nn.Module):
    def __init__(self, state, hidden=8, ffn=16):
        super().__init__()
        self.tracker = state.rng_tracker
        self.fc1 = ColumnParallelLinear(hidden, ffn, state.tp_group)
        self.fc2 = RowParallelLinear(ffn, hidden, state.tp_group)

    def forward(self, x):
        h = F.gelu(self.fc1(x))
        with self.tracker.fork():  # per-TP-rank dropout stream
            h = F.dropout(h, p=0.3)
        return F.dropout(self.fc2(h), p=0.3)  # default stream


class Sched:
    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, sd):
        self.n = sd["n"]


def _build(state, seed):
    torch.manual_seed(seed)  # the master weights are drawn from the default generator
    model = TPBlock(state)
    model_parallel_seed(seed, state)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), Sched()


def _steps(model, opt, sched, n):
    losses = []
    for _ in range(n):
        x = torch.randn(4, 8)  # same on both ranks: the default stream is shared by TP ranks
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.n += 1
        losses.append(loss.item())
    return losses


def _config(root):
    cfg = Config()
    cfg.parallel.tensor_model_parallel_size = 2
    cfg.checkpoint.save = cfg.checkpoint.load = root
    return cfg


def resume_matches_uninterrupted(root):
    state = cached_state(tp=2)
    cfg = _config(root)
    model, opt, sched = _build(state, 1234)
    _steps(model, opt, sched, 2)
    save_checkpoint(2, [model], opt, sched, 8, cfg, state)
    after_save = torch.get_rng_state()
    uninterrupted = _steps(model, opt, sched, 3)
    final = {k: v.clone() for k, v in model.state_dict().items()}

    model2, opt2, sched2 = _build(state, 777)  # another start: other weights and RNG
    assert load_checkpoint([model2], opt2, sched2, cfg, state) == (2, 8)
    assert torch.equal(torch.get_rng_state(), after_save) and sched2.n == 2
    resumed = _steps(model2, opt2, sched2, 3)
    assert resumed == uninterrupted, (resumed, uninterrupted)
    assert all(torch.equal(v, final[k]) for k, v in model2.state_dict().items())
    files = sorted(os.listdir(os.path.join(root, "iter_0000002")))
    return files, sorted(os.listdir(os.path.join(root, "iter_0000002", "rng"))), uninterrupted


def test_resume_matches_uninterrupted_run(tmp_path):
    results = run_ranks(2, resume_matches_uninterrupted, str(tmp_path / "ckpt"))
    assert results[0][0] == ["mp_rank_00_000", "mp_rank_01_000", "rng"]
    assert results[0][1] == ["rank_00000.pt", "rank_00001.pt"]
    # Both TP ranks saw the same replicated output loss; their dropout streams differ inside the
    # TP region, which the per-rank RNG files restore.
    assert results[0][2] == results[1][2]


def refuse_other_tp_size(root):
    state2 = cached_state(tp=2)
    model, opt, sched = _build(state2, 1)
    save_checkpoint(5, [model], opt, sched, 20, _config(root), state2)
    state1 = cached_state(tp=1)  # same 2 ranks as data parallel
    cfg = _config(root)
    cfg.parallel.tensor_model_parallel_size = 1
    torch.manual_seed(1)
    model1 = TPBlock(state1)
    try:
        load_checkpoint([model1], None, None, cfg, state1)
    except CheckpointError as err:
        message = str(err)
    else:
        message = None
    dist.barrier()

    # The other way round: TP rank 1 finds no mp_rank_01_000 file and must still name the TP size.
    other_root = root + "_tp1"
    opt1 = torch.optim.AdamW(model1.parameters())
    cfg.checkpoint.save = other_root
    save_checkpoint(6, [model1], opt1, None, 24, cfg, state1)
    cfg2 = _config(other_root)
    try:
        load_checkpoint([model], opt, sched, cfg2, state2)
    except CheckpointError as err:
        reverse = str(err)
    else:
        reverse = None
    dist.barrier()
    return message, reverse


def test_tp_size_mismatch_is_refused(tmp_path):
    root = str(tmp_path / "ckpt")
    results = run_ranks(2, refuse_other_tp_size, root)
    for msg, reverse in results:
        assert msg == (f"checkpoint {root}/iter_0000005/mp_rank_00_000/model_optim_rng.pt was saved with "
                       "--tensor-model-parallel-size 2, this run has --tensor-model-parallel-size 1: pass "
                       "--tensor-model-parallel-size 2, or convert it with tools/checkpoint/convert.py "
                       "--target-tensor-parallel-size 1")
        assert reverse == (f"checkpoint {root}_tp1/iter_0000006/mp_rank_00_000/model_optim_rng.pt was saved with "
                           "--tensor-model-parallel-size 1, this run has --tensor-model-parallel-size 2: pass "
                           "--tensor-model-parallel-size 1, or convert it with tools/checkpoint/convert.py "
                           "--target-tensor-parallel-size 2")
