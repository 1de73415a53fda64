"""Shared pieces of the checkpoint-conversion tests: random weights that are the same model at any
TP x PP x EP layout, the command line, and bit-exact comparisons of merged weights."""

import re

import torch

from megatron_lite.models.common import param_seed
from megatron_lite.parallel.tensor import shard
from tests.tools import load_tool

_LAYER = re.compile(r"^(decoder|encoder)\.layers\.(\d+)\.(.*)$")
_SEQ_EXPERT = re.compile(r"^(.*\.local_experts\.)(\d+)(\..*)$")
VOCAB_TENSORS = ("embedding.word_embeddings.weight", "output_layer.weight", "output_layer.bias")


def global_name(model, name: str, first_expert: int = 0) -> str:
    """The single-process name of chunk tensor ``name`` (global layer and expert numbers)."""
    m = _LAYER.match(name)
    if m:
        name = f"{m.group(1)}.layers.{model.layer_start + int(m.group(2))}.{m.group(3)}"
    m = _SEQ_EXPERT.match(name)
    if m:
        name = f"{m.group(1)}{first_expert + int(m.group(2))}{m.group(3)}"
    if name == "output_layer.weight" and model.tied:
        return "embedding.word_embeddings.weight"
    return name


def randomize(model, state, seed: int = 99, grad: bool = False) -> None:
    """Replace every parameter (and the router's expert bias) by random values drawn for its *full*
    single-process tensor, seeded by its global name; this rank keeps its TP shard and EP part.
    ``grad``: set the parameters' ``.grad`` instead (a tied embedding's two copies get the same)."""
    experts = model.config.num_experts or 0
    first = state.ep_rank * (experts // state.ep_size) if experts else 0
    tensors = list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers() if n.endswith("expert_bias")]
    for name, p in tensors:
        shape = list(p.shape)
        # a folded grid splits the experts over its own ETP group
        rank, size = ((state.etp_rank, state.etp_size) if getattr(state, "folded", False) and ".mlp.experts." in name
                      else (state.tp_rank, state.tp_size))
        tp_split = getattr(p, "tensor_model_parallel", False) and size > 1
        if tp_split:
            shape[p.partition_dim] *= size
        grouped = ".experts.weight" in name or ".experts.bias" in name
        if grouped:
            shape[0] *= state.ep_size
        gen = torch.Generator().manual_seed(param_seed(seed, 0, global_name(model, name, first)))
        full = torch.randn(shape, generator=gen) * 0.3 + (1.0 if "norm" in name and name.endswith("weight") else 0)
        if grouped:
            full = full.chunk(state.ep_size)[state.ep_rank]
        if tp_split:
            full = shard(full, p.partition_dim, rank, size, getattr(p, "partition_stride", 1))
        if grad:
            p.grad = full.to(p.dtype) if isinstance(p, torch.nn.Parameter) else None
            continue
        with torch.no_grad():
            p.copy_(full)


def convert(model_type: str, *argv) -> int:
    """tools/checkpoint/convert.py in this process; returns its exit code."""
    return load_tool("checkpoint/convert").main(["--model-type", model_type, *map(str, argv)])


def assert_same_weights(got: dict, want: dict, vocab_rows: int) -> None:
    """Bit-exact; vocabulary tensors on their real rows, padded rows zero in the converted one."""
    assert set(got) == set(want)
    for k, v in want.items():
        if k in VOCAB_TENSORS:
            assert torch.equal(got[k][:vocab_rows], v[:vocab_rows]), k
            assert not got[k][vocab_rows:].any(), k
        else:
            assert torch.equal(got[k], v), k


def same_optimizer(got: dict, want: dict, shard_rows: int, real_rows: int) -> None:
    """Adam moments and fp32 masters bit for bit, in training's order and groups; vocabulary shards
    (``shard_rows`` rows) on their ``real_rows`` real rows only."""
    assert got["optimizer"]["param_groups"] == want["optimizer"]["param_groups"]
    assert got["optimizer"]["state"].keys() == want["optimizer"]["state"].keys() and want["optimizer"]["state"]
    pairs = list(zip(got["fp32_masters"] or [], want["fp32_masters"] or [], strict=True))
    for i, entry in want["optimizer"]["state"].items():
        pairs += [(got["optimizer"]["state"][i][k], v) for k, v in entry.items()]
    for a, b in pairs:
        rows = real_rows if a.dim() > 0 and a.shape[0] == shard_rows else None
        assert a.shape == b.shape and (torch.equal(a[:rows], b[:rows]) if a.dim() else torch.equal(a, b))


def save_ours(folder, model: dict, moe: dict) -> str:
    """A random model of ours of these ``ModelConfig`` and ``MoEConfig`` fields (a padded vocabulary of 104),
    saved as iteration 5 under ``folder`` (a path); returns the checkpoint folder."""
    from megatron_lite.checkpoint import save_checkpoint
    from megatron_lite.config import Config, ModelConfig
    from megatron_lite.models import GPTModel, TransformerConfig
    from megatron_lite.moe.config import MoEConfig, moe_fields
    from megatron_lite.parallel.state import ParallelState

    model_cfg = ModelConfig(**model)
    model_cfg.padded_vocab_size = 104
    config = Config(model=model_cfg, moe=MoEConfig(**moe))
    state = ParallelState()
    tc = TransformerConfig.from_model(config.model, tensor_model_parallel_size=1, **moe_fields(config.moe))
    net = GPTModel(tc, state).eval()
    randomize(net, state)
    config.checkpoint.save = str(folder / "ckpt")
    save_checkpoint(5, [net], None, None, 40, config, state)
    return config.checkpoint.save
