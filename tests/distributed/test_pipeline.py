"""Pipeline schedules on real gloo groups against the single-process run of the same model.

The toy model is a stack of L tensor-parallel MLP layers ``h = tanh(Row(tanh(Col(h))))`` (hidden 8,
every layer's full weights drawn from a generator seeded by its global layer number, so any
TP/PP split holds slices of the same weights) with a mean-squared-error loss on the last stage.
The reference runs the whole stack in this process over the same micro-batches, back-propagating
``loss * SCALE / m`` of each (the schedule divides by m and applies grad_scale_func). Every rank
must report the same per-micro-batch losses (last stage) and hold the same gradient for each of
its parameters as the reference's slice, fp32 rtol 1e-5 atol 1e-6 (TP sums in another order). The
sent activations must have been released (1 element left). The recorded schedule trace must equal the op order that :mod:`order` (and so the simulator)
predicts, and its wall-clock times must respect the stage order across ranks.
"""


import pytest
import torch
from torch import nn

from megatron_lite.parallel import comm
from megatron_lite.parallel.pipeline import PipeComm, get_forward_backward_func, layer_ranges
from megatron_lite.parallel.pipeline.order import rank_order
from megatron_lite.parallel.pipeline.trace import Trace
from megatron_lite.parallel.tensor import ColumnParallelLinear, RowParallelLinear, normal_init, shard
from tests.harness import cached_state, run_ranks

H, S, B = 8, 4, 2
SCALE = 2.0  # grad_scale_func multiplies the loss by this before backward (a loss scaler)


class ToyChunk(nn.Module):
    """Global layers [start, end) of the toy stack; reads data on the first stage."""

    def __init__(self, start, end, tp_group=None, sp=False, pre=True, post=True):
        super().__init__()
        self.pre, self.post, self.sp, self.tp_group = pre, post, sp, tp_group
        self.layers = nn.ModuleList()
        for i in range(start, end):
            col = ColumnParallelLinear(H, 2 * H, tp_group, init_method=normal_init(0.5, torch.Generator().manual_seed(100 + i)),
                                       sequence_parallel=sp)
            row = RowParallelLinear(2 * H, H, tp_group, init_method=normal_init(0.5, torch.Generator().manual_seed(200 + i)),
                                    sequence_parallel=sp)
            with torch.no_grad():
                row.bias.copy_(torch.randn(H, generator=torch.Generator().manual_seed(300 + i)) * 0.1)
            self.layers.append(nn.ModuleList([col, row]))
        self.start = start
        self.input_tensor = None
        self.sent = []  # outputs this chunk produced (to check they were released after sending)

    def set_input_tensor(self, x):
        self.input_tensor = x

    def forward(self, x):
        if self.pre:
            h = comm.scatter_to_sp(x, self.tp_group) if self.sp else x
        else:
            h = self.input_tensor
        for col, row in self.layers:
            h = torch.tanh(row(torch.tanh(col(h))))
        if self.post and self.sp:
            h = comm.gather_from_sp(h, self.tp_group, tensor_parallel_output_grad=False)
        if not self.post:
            self.sent.append(h)
        return h


def micro_batches(m, dp_rank=0):
    out = []
    for i in range(m):
        g = torch.Generator().manual_seed(1000 * dp_rank + i)
        out.append({"x": torch.randn(S, B, H, generator=g), "y": torch.randn(S, B, H, generator=g)})
    return out


def forward_step(data_iterator, chunk):
    batch = next(data_iterator)
    out = chunk(batch["x"] if chunk.pre else None)

    def loss_func(h):
        loss = ((h - batch["y"]) ** 2).mean()
        return loss, {"loss": loss.detach()}

    return out, loss_func


def reference(num_layers, m, dp=1):
    """Single-process run: per-micro-batch losses of each data-parallel rank's micro-batches, and
    the full gradient of each parameter for the global batch (all ranks' micro-batches, mean loss)."""
    model = ToyChunk(0, num_layers)
    losses = [[] for _ in range(dp)]
    for d in range(dp):
        for batch in micro_batches(m, d):
            loss = ((model(batch["x"]) - batch["y"]) ** 2).mean()
            (loss * SCALE / (m * dp)).backward()
            losses[d].append(loss.item())
    return losses, {name: p.grad.clone() for name, p in _global_params(model)}


def _global_params(chunk):
    """(global name, parameter): 'layer{i}.{col|row}.{weight|bias}' with the global layer number."""
    for j, (col, row) in enumerate(chunk.layers):
        for part, mod in (("col", col), ("row", row)):
            for pname, p in mod.named_parameters():
                yield f"layer{chunk.start + j}.{part}.{pname}", p


def _record_grad_arrivals(params, trace) -> list:
    """Hooks that note, each time a parameter's ``.grad`` changes, how many ops had completed: the
    op running then is ``trace[that count]`` once the schedule is done."""
    arrivals, last = [], {}

    def hook(p, name):
        if p.grad is not None and (name not in last or not torch.equal(p.grad, last[name])):
            arrivals.append((len(trace), name))
            last[name] = p.grad.clone()

    for name, p in params:
        p.register_post_accumulate_grad_hook(lambda p, name=name: hook(p, name))
    return arrivals


def run_pipeline(num_layers, m, tp=1, pp=2, vpp_layers=None, sp=False, forward_only=False, schedule="1f1b",
                 grad_arrivals=False):
    """Worker: build this rank's chunks, run the schedule, return losses, grads (as reference slices) and
    trace; with ``grad_arrivals`` also ``(kind, microbatch, name)`` of the op during which each
    parameter's gradient changed, in order."""
    v = 1 if vpp_layers is None else num_layers // (pp * vpp_layers)
    state = cached_state(tp=tp, pp=pp, **({"vpp": v} if v > 1 else {}))
    ranges = layer_ranges(num_layers, pp, vpp_layers)[state.pp_rank]
    chunks = [
        ToyChunk(a, b, state.tp_group, sp, pre=state.is_first_stage() and c == 0,
                 post=state.is_last_stage() and c == len(ranges) - 1)
        for c, (a, b) in enumerate(ranges)
    ]
    data = [iter(micro_batches(m, state.dp_rank)) for _ in chunks]
    trace = Trace()
    exits = []

    class NoSync:  # records how many ops had run when gradient sync was switched back on
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            exits.append(len(trace))

    arrivals = _record_grad_arrivals([(n, p) for c in chunks for n, p in _global_params(c)], trace) if grad_arrivals else []
    pipe_comm = PipeComm.for_activations(state, seq_length=S, micro_batch_size=B, hidden_size=H, dtype=torch.float32,
                                         sequence_parallel=sp)
    reported = get_forward_backward_func(state, schedule)(
        forward_step_func=forward_step, data_iterator=data if v > 1 else data[0], model=chunks,
        num_microbatches=m, comm=pipe_comm, forward_only=forward_only, grad_scale_func=lambda loss: loss * SCALE,
        no_sync_func=NoSync, trace=trace,
    )
    params = [(n, p) for c in chunks for n, p in _global_params(c)]
    if sp:
        from megatron_lite.parallel.tensor import all_reduce_sequence_parallel_grads
        all_reduce_sequence_parallel_grads([p for _, p in params], state.tp_group)
    grads = {}
    for name, p in params:
        if p.grad is None:
            continue
        g = p.grad.clone()
        if state.dp_group is not None:  # average over data-parallel ranks, as DDP would
            torch.distributed.all_reduce(g, group=state.dp_group)
            g /= state.dp_size
        grads[name] = (g, getattr(p, "partition_dim", None), state.tp_rank)
    released = all(t.numel() == 1 for c in chunks for t in c.sent)
    return {
        "pp_rank": state.pp_rank, "dp_rank": state.dp_rank, "tp": tp, "losses": [r["loss"].item() for r in reported], "grads": grads,
        "trace": list(trace), "times": list(trace.times), "sync_on_at": exits, "released": released, "v": v,
        "schedule": schedule, "arrivals": [(trace[i].kind, trace[i].microbatch, name) for i, name in arrivals],
    }


def check_against_reference(results, num_layers, m, pp, dp=1, forward_only=False):
    ref_losses, ref_grads = reference(num_layers, m, dp)
    seen = set()
    for res in results:
        if res["pp_rank"] == pp - 1:
            torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(ref_losses[res["dp_rank"]]), rtol=1e-5, atol=1e-6)
        else:
            assert res["losses"] == []
        if forward_only:
            assert res["grads"] == {}
            continue
        for name, (g, dim, tp_rank) in res["grads"].items():
            expected = ref_grads[name] if dim is None else shard(ref_grads[name], dim, tp_rank, res["tp"])
            torch.testing.assert_close(g, expected, rtol=1e-5, atol=1e-6, msg=lambda s, n=name: f"{n}: {s}")
            seen.add(name)
        assert res["released"], "an activation sent to the next stage kept its storage"
    if not forward_only:
        assert seen == set(ref_grads), f"gradients missing for {set(ref_grads) - seen}"


def check_trace(results, m, pp, forward_only=False):
    """The recorded order is the predicted one; stage order holds across ranks in wall-clock time;
    data-parallel sync came back on right before the rank's last backward."""
    start, end = {}, {}
    for res in results:
        r, v = res["pp_rank"], res["v"]
        ops = [(e.kind, e.microbatch, e.chunk) for e in res["trace"]]
        expected = [op for op in rank_order(pp, r, m, v, res["schedule"]) if not forward_only or op[0] == "F"]
        assert ops == expected
        assert [e.step for e in res["trace"]] == list(range(len(ops)))
        if not forward_only:
            assert res["sync_on_at"] == [len(ops) - 1]
        for (kind, mb, c), (t0, t1) in zip(ops, res["times"]):
            start[(kind, mb, c * pp + r)], end[(kind, mb, c * pp + r)] = t0, t1
    stages = max(k[2] for k in start) + 1
    for (kind, mb, s), t0 in start.items():
        if kind == "F" and s > 0:
            assert end[("F", mb, s - 1)] <= t0, f"forward of micro-batch {mb} on stage {s} started before stage {s - 1}'s"
        if kind == "B":
            assert end[("F", mb, s)] <= t0
            if s < stages - 1:
                assert end[("B", mb, s + 1)] <= t0, f"backward of micro-batch {mb} on stage {s} ran before stage {s + 1}'s"
        if kind == "W":
            assert end[("B", mb, s)] <= t0, f"weight gradients of micro-batch {mb} on stage {s} ran before its B"


@pytest.mark.parametrize("pp, m", [(2, 3), (4, 6), (4, 3)])
def test_1f1b_matches_single_process(pp, m):
    results = run_ranks(pp, run_pipeline, 4, m, 1, pp)
    check_against_reference(results, 4, m, pp)
    check_trace(results, m, pp)


@pytest.mark.parametrize("pp, m, layers", [(2, 4, 4), (2, 2, 4), (2, 6, 6), (4, 8, 8), (4, 4, 8)])
def test_interleaved_matches_single_process(pp, m, layers):
    """One layer per virtual stage, so v = layers / pp chunks per rank; m = p runs all-warmup."""
    results = run_ranks(pp, run_pipeline, layers, m, 1, pp, 1)
    check_against_reference(results, layers, m, pp)
    check_trace(results, m, pp)


def test_pipeline_with_data_parallel():
    """PP=2 x DP=2: each data-parallel rank runs its own micro-batches; averaged grads = global batch."""
    results = run_ranks(4, run_pipeline, 4, 4, 1, 2)
    assert sorted((r["pp_rank"], r["dp_rank"]) for r in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    check_against_reference(results, 4, 4, 2, dp=2)
    check_trace(results[:1] + results[2:3], 4, 2)  # one pipeline: global ranks 0 (stage 0) and 2 (stage 1)


@pytest.mark.parametrize("sp", [False, True])
def test_tensor_and_pipeline_parallel(sp):
    results = run_ranks(4, run_pipeline, 4, 4, 2, 2, None, sp)
    check_against_reference(results, 4, 4, 2)
    check_trace(results, 4, 2)


def test_tensor_pipeline_interleaved_sequence_parallel():
    results = run_ranks(4, run_pipeline, 4, 4, 2, 2, 1, True)
    check_against_reference(results, 4, 4, 2)


@pytest.mark.parametrize("vpp_layers", [None, 1])
def test_forward_only(vpp_layers):
    with torch.no_grad():
        results = run_ranks(2, run_pipeline, 4, 4, 1, 2, vpp_layers, False, True)
    check_against_reference(results, 4, 4, 2, forward_only=True)
    check_trace(results, 4, 2, forward_only=True)


# ---------------------------------------------------------------------------------------------
# The real GPTModel split into pipeline chunks (as pretrain_gpt.py's model_provider builds them)
# through the schedules, against the single-process GPTModel: per-micro-batch losses and every
# parameter gradient (TP shards unsharded, sequence-parallel grads all-reduced over TP, the tied
# embedding/output copies summed over the embedding group), fp32 rtol 1e-5 atol 1e-6 / 1e-7. The
# hidden states a chunk sent on must have been released.

GPT_LAYERS = 4


def _gpt_batches(m):
    from tests.unit.test_gpt_model import make_batch

    return [make_batch(50 + i) for i in range(m)]


_GPT_SENT = []  # hidden states the non-last chunks sent on (must be released after sending)


def _gpt_forward_step(data_iterator, model):
    tokens, labels = next(data_iterator)
    out = model(tokens, labels=labels)
    if not model.post_process:
        _GPT_SENT.append(out)
    return out, lambda loss: (loss.mean(), {"lm loss": loss.mean().detach()})


def gpt_reference(variant, m):
    from megatron_lite.parallel.state import ParallelState
    from tests.model_helpers import build_gpt
    from tests.unit.test_gpt_model import make_config

    model = build_gpt(make_config(variant, num_layers=GPT_LAYERS), ParallelState(), seed=9)
    losses = []
    for tokens, labels in _gpt_batches(m):
        loss = model(tokens, labels=labels).mean()
        (loss / m).backward()
        losses.append(loss.item())
    return losses, {n: p.grad.clone() for n, p in model.named_parameters()}


def run_gpt_pipeline(variant, m, tp, pp, sp=False, vpp_layers=None):
    from megatron_lite.parallel.tensor import all_reduce_sequence_parallel_grads
    from tests.distributed.test_gpt_model import _full
    from tests.model_helpers import build_gpt
    from tests.unit.test_gpt_model import make_config

    v = 1 if vpp_layers is None else GPT_LAYERS // (pp * vpp_layers)
    state = cached_state(tp=tp, pp=pp, **({"vpp": v} if v > 1 else {}))
    cfg = make_config(variant, num_layers=GPT_LAYERS)
    ranges = layer_ranges(GPT_LAYERS, pp, vpp_layers)[state.pp_rank]
    chunks = [
        build_gpt(cfg, state, seed=9, sequence_parallel=sp, pre_process=state.is_first_stage() and c == 0,
                 post_process=state.is_last_stage() and c == len(ranges) - 1, layer_start=a, layer_end=b)
        for c, (a, b) in enumerate(ranges)
    ]
    data = [iter(_gpt_batches(m)) for _ in chunks]
    _GPT_SENT.clear()
    pipe_comm = PipeComm.for_activations(state, seq_length=cfg.seq_length, micro_batch_size=2,
                                         hidden_size=cfg.hidden_size, dtype=torch.float32, sequence_parallel=sp)
    reported = get_forward_backward_func(state)(
        forward_step_func=_gpt_forward_step, data_iterator=data if v > 1 else data[0], model=chunks,
        num_microbatches=m, comm=pipe_comm,
    )
    grads = {}
    for chunk, (start, _) in zip(chunks, ranges):
        all_reduce_sequence_parallel_grads(chunk.parameters(), state.tp_group)
        shared = chunk.shared_embedding_or_output_weight()
        if shared is not None and state.in_embedding_group():  # what finalize_model_grads does
            torch.distributed.all_reduce(shared.grad, group=state.embedding_group)
        for name, p in chunk.named_parameters():
            full = _full(p, p.grad, state.tp_group, tp) if tp > 1 else p.grad.clone()
            if name.startswith("decoder.layers."):
                local, rest = name[len("decoder.layers."):].split(".", 1)
                name = f"decoder.layers.{start + int(local)}.{rest}"
            if p is shared and not chunk.pre_process:
                name = "embedding.word_embeddings.weight"  # the last stage's copy of the tied weight
            grads[name] = full
    released = all(t.numel() == 1 for t in _GPT_SENT) and len(_GPT_SENT) == m * sum(not c.post_process for c in chunks)
    _GPT_SENT.clear()
    return {"losses": [r["lm loss"].item() for r in reported], "grads": grads, "last": state.is_last_stage(),
            "released": released}


@pytest.mark.parametrize("variant, m, tp, pp, sp, vpp_layers, world", [
    ("A", 3, 1, 2, False, None, 2),   # 1F1B, tied embedding/output weights
    ("B", 4, 1, 2, False, 1, 2),      # interleaved, 2 chunks of 1 layer per rank, untied
    ("A", 4, 2, 2, True, None, 4),    # TP=2 x PP=2 with sequence parallelism
    ("B", 2, 2, 2, True, 1, 4),       # TP=2 x PP=2, SP, interleaved (m = p: all warmup)
])
def test_gpt_through_the_schedules_matches_single_process(variant, m, tp, pp, sp, vpp_layers, world):
    ref_losses, ref_grads = gpt_reference(variant, m)
    results = run_ranks(world, run_gpt_pipeline, variant, m, tp, pp, sp, vpp_layers)
    seen = set()
    for res in results:
        if res["last"]:
            torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        for name, g in res["grads"].items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-7, msg=lambda s, n=name: f"{n}: {s}")
            seen.add(name)
        assert res["released"], "a GPT chunk's sent hidden states kept their storage"
    assert seen == set(ref_grads)
