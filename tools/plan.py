#!/usr/bin/env python3
"""Plan a parallel layout: memory per GPU and estimated step time of every layout of a model on a cluster.

Every TP x PP x VPP x DP x CP x EP (x expert TP) split, ZeRO sharding strategy, recomputation and micro-batch size
that can run the model is estimated from closed forms (model state bytes per parameter, Korthikanti
et al.'s activation bytes, Narayanan et al.'s FLOPs at a fixed matmul efficiency, ring
communication volumes over NVLink / network bandwidth, the (p-1)/(v m) pipeline bubble of 1F1B or
ZB-H1's (p-1)/(3m), interleaved zero bubble's (p-1)/(3vm)); the
layouts that fit in GPU memory are printed fastest first, with the best one broken down.

    python tools/plan.py --preset gpt3-175b --cluster a100 --gpus 1024 --global-batch-size 1536
    python tools/plan.py --preset llama3-70b --cluster h100 --gpus 64 --global-batch-size 512 --png plan.png
    python tools/plan.py --preset deepseek-v3 --cluster h100 --gpus 1024 --global-batch-size 15360 \
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 16 --expert-model-parallel-size 32
    python tools/plan.py --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 4096 \\
        --vocab-size 50257 --gpus 16 --peak-tflops 312 --global-batch-size 256 --tensor-model-parallel-size 2

Model flags (Megatron names) override a preset's values; cluster flags override --cluster's.
Layout flags (--tensor-model-parallel-size, ...) keep only the layouts with that value (any value; one no
layout can take is refused, naming the flag and the reason).
The split of the layers over the pipeline stages takes training's flags (--pipeline-model-parallel-layout,
--account-for-embedding/loss-in-pipeline-split, --decoder-first/last-pipeline-num-layers) and training's
ranges (pipeline_ranges); --moe-use-upcycling / --moe-upcycling-granularity are checked as in training and
change nothing in the plan.
Exit code 2 with one line on stderr for a bad option.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lite.errors import ConfigError, OneLineParser, run_tool  # noqa: E402
from megatron_lite.models.mla_config import MLA_SIZES  # noqa: E402
from megatron_lite.moe.config import MoEConfig  # noqa: E402
from megatron_lite.moe.upcycling import upcycling_problem  # noqa: E402
from megatron_lite.perf.numbers import count, figure  # noqa: E402
from megatron_lite.perf.plan import (  # noqa: E402
    CLUSTER_PRESETS,
    MATMUL_EFFICIENCY,
    MODEL_PRESETS,
    ClusterSpec,
    ModelSpec,
    active_params,
    format_table,
    plan,
    stage_params,
)
from megatron_lite.training.outputs import check_output_file, save_figure  # noqa: E402


def _at_least(low, kind=int):
    """An argparse type: a ``kind`` number not below ``low`` (a bad one is the parser's one-line error)."""
    def parse(text):
        value = kind(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {text}")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in "invalid int value"
    return parse


def _positive_float(text):
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


_positive_float.__name__ = "float"
POSITIVE = _at_least(1)

MODEL_FLAGS = {  # flag -> (ModelSpec field, type)
    "--num-layers": ("num_layers", POSITIVE), "--hidden-size": ("hidden_size", POSITIVE),
    "--num-attention-heads": ("num_attention_heads", POSITIVE), "--seq-length": ("seq_length", POSITIVE),
    "--ffn-hidden-size": ("ffn_hidden_size", POSITIVE), "--num-query-groups": ("num_query_groups", POSITIVE),
    "--vocab-size": ("vocab_size", POSITIVE), "--num-experts": ("num_experts", POSITIVE),
    "--moe-router-topk": ("moe_router_topk", POSITIVE), "--moe-ffn-hidden-size": ("moe_ffn_hidden_size", POSITIVE),
    "--make-vocab-size-divisible-by": ("make_vocab_size_divisible_by", POSITIVE),
    "--moe-shared-expert-intermediate-size": ("moe_shared_expert_intermediate_size", POSITIVE),
    "--moe-layer-freq": ("moe_layer_freq", str), "--q-lora-rank": ("q_lora_rank", POSITIVE),
    "--kv-lora-rank": ("kv_lora_rank", POSITIVE), "--qk-head-dim": ("qk_head_dim", POSITIVE),
    "--qk-pos-emb-head-dim": ("qk_pos_emb_head_dim", POSITIVE), "--v-head-dim": ("v_head_dim", POSITIVE),
    "--mtp-num-layers": ("mtp_num_layers", _at_least(0)), "--normalization": ("normalization", str),
    "--window-size": ("window_size", _at_least(-1)), "--window-attn-skip-freq": ("window_attn_skip_freq", str),
}
CLUSTER_FLAGS = {"--gpus-per-node": POSITIVE, "--gpu-memory-gb": _positive_float, "--peak-tflops": _positive_float,
                 "--intra-node-gbps": _positive_float, "--inter-node-gbps": _positive_float}
SPLIT_ARGS = {"pipeline_layout": "pipeline_model_parallel_layout", "first": "decoder_first_pipeline_num_layers",
              "last": "decoder_last_pipeline_num_layers", "account_embedding": "account_for_embedding_in_pipeline_split",
              "account_loss": "account_for_loss_in_pipeline_split"}  # Layout field -> argparse name
LAYOUT_FLAGS = {  # flag -> (Layout field, type, choices)
    "--tensor-model-parallel-size": ("tp", POSITIVE, None), "--pipeline-model-parallel-size": ("pp", POSITIVE, None),
    "--virtual-pipeline-model-parallel-size": ("vpp", POSITIVE, None), "--context-parallel-size": ("cp", POSITIVE, None),
    "--expert-model-parallel-size": ("ep", POSITIVE, None), "--micro-batch-size": ("micro_batch", POSITIVE, None),
    "--expert-tensor-parallel-size": ("etp", POSITIVE, None),
    "--data-parallel-sharding-strategy": ("zero", str, ["no_shard", "optim", "optim_grads", "optim_grads_params"]),
    "--recompute-granularity": ("recompute", str, ["none", "selective", "full"]),
    "--num-distributed-optimizer-instances": ("instances", POSITIVE, None),
    "--pipeline-schedule": ("schedule", str, ["1f1b", "zb-h1"]),
}


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(MODEL_PRESETS), help="a published model's shapes")
    for flag, (_, kind) in MODEL_FLAGS.items():
        ap.add_argument(flag, type=kind, choices=["LayerNorm", "RMSNorm"] if flag == "--normalization" else None,
                        **({"nargs": 2, "metavar": ("LEFT", "RIGHT")} if flag == "--window-size" else {}))
    ap.add_argument("--group-query-attention", action="store_true", default=None,
                    help="grouped-query attention with --num-query-groups groups (alone: 1, as in training)")
    ap.add_argument("--swiglu", action="store_true", default=None)
    ap.add_argument("--disable-bias-linear", action="store_true", default=None)
    ap.add_argument("--untie-embeddings-and-output-weights", action="store_true", default=None)
    ap.add_argument("--multi-latent-attention", action="store_true", default=None)
    ap.add_argument("--qk-layernorm", action="store_true", default=None)
    ap.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"])
    ap.add_argument("--cluster", choices=sorted(CLUSTER_PRESETS), default="a100",
                    help="GPU preset (a100: DGX A100 80GB, h100: DGX H100); default a100")
    ap.add_argument("--gpus", type=POSITIVE, required=True)
    for flag, kind in CLUSTER_FLAGS.items():
        ap.add_argument(flag, type=kind, help="bandwidths in GB/s (gigabytes) per GPU per direction"
                        if flag.endswith("gbps") else None)
    ap.add_argument("--global-batch-size", type=POSITIVE, required=True)
    for flag, (_, kind, choices) in LAYOUT_FLAGS.items():
        ap.add_argument(flag, type=kind, choices=choices)
    ap.add_argument("--pipeline-model-parallel-layout", metavar="LAYOUT",
                    help="what each (virtual) pipeline stage holds, as in training, e.g. 'Et|tt|tL'")
    ap.add_argument("--decoder-first-pipeline-num-layers", type=int)
    ap.add_argument("--decoder-last-pipeline-num-layers", type=int)
    ap.add_argument("--account-for-embedding-in-pipeline-split", action="store_true", default=None)
    ap.add_argument("--account-for-loss-in-pipeline-split", action="store_true", default=None)
    ap.add_argument("--moe-use-upcycling", action="store_true", default=None,
                    help="accepted as in training (checked the same way); the upcycled model is planned as the MoE model")
    ap.add_argument("--moe-upcycling-granularity", type=int)
    ap.add_argument("--use-precision-aware-optimizer", action="store_true",
                    help="as in training: Adam's moments in the dtypes below (sharded strategies only)")
    for flag in ("--exp-avg-dtype", "--exp-avg-sq-dtype"):
        ap.add_argument(flag, choices=["fp32", "bf16"], default="fp32", help="as in training (default fp32)")
    ap.add_argument("--top", type=POSITIVE, default=20, help="rows to print (default 20)")
    ap.add_argument("--png", help="draw memory and step time of the printed layouts to this PNG")
    return ap


def model_from_args(args) -> ModelSpec:
    """The preset (if any) with every given model flag applied."""
    given = {field: getattr(args, flag[2:].replace("-", "_")) for flag, (field, _) in MODEL_FLAGS.items()}
    given = {k: v for k, v in given.items() if v is not None}
    for name, field, value in (("swiglu", "swiglu", True), ("disable_bias_linear", "add_bias_linear", False),
                               ("untie_embeddings_and_output_weights", "untie_embeddings_and_output_weights", True),
                               ("multi_latent_attention", "multi_latent_attention", True),
                               ("qk_layernorm", "qk_layernorm", True)):
        if getattr(args, name):
            given[field] = value
    if args.position_embedding_type:
        given["learned_positions"] = args.position_embedding_type == "learned_absolute"
    _query_groups(args, given)
    if args.preset:
        spec = _refuse_unused(dataclasses.replace(MODEL_PRESETS[args.preset], **given), given)
    else:
        missing = [f for f in ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length", "--vocab-size")
                   if MODEL_FLAGS[f][0] not in given]
        if missing:
            raise ConfigError(f"give --preset or the model flags {' '.join(missing)}")
        spec = _refuse_unused(ModelSpec(**given), given)
    _check_upcycling(args, spec)
    return spec


def _check_upcycling(args, spec: ModelSpec) -> None:
    """--moe-use-upcycling / --moe-upcycling-granularity: training's checks (megatron_lite.moe.upcycling)
    on the planned model, its dense checkpoint assumed given. Upcycling sets the experts' first values
    only: the model built, its parameters, memory and FLOPs are the MoE model's, so nothing else changes."""
    granularity = args.moe_upcycling_granularity
    if not args.moe_use_upcycling and granularity is None:
        return
    moe = MoEConfig(num_experts=spec.num_experts, moe_router_topk=spec.moe_router_topk,
                    moe_shared_expert_intermediate_size=spec.moe_shared_expert_intermediate_size,
                    moe_use_upcycling=bool(args.moe_use_upcycling), moe_upcycling_granularity=1 if granularity is None else granularity)
    checkpoint = SimpleNamespace(load="(the dense checkpoint)", pretrained_checkpoint=None, use_checkpoint_args=False)
    problem = upcycling_problem(SimpleNamespace(moe=moe, checkpoint=checkpoint, lora=None))
    if problem:
        raise ConfigError(problem)


def _query_groups(args, given: dict) -> None:
    """Training's rule: --group-query-attention alone is one key/value group; --num-query-groups needs it
    (a preset's own groups stand as they are)."""
    if args.group_query_attention:
        given.setdefault("num_query_groups", 1)
    elif "num_query_groups" in given:
        groups = given["num_query_groups"]
        raise ConfigError(f"--num-query-groups {groups} needs --group-query-attention (as in training, where "
                          "without it every head has its own key/value); add --group-query-attention")


def _refuse_unused(spec: ModelSpec, given: dict) -> ModelSpec:
    """``spec``, unless a given MoE flag has no experts or an MLA size no --multi-latent-attention to
    apply to: one ConfigError naming it, as training refuses it."""
    for flag, (field, _) in MODEL_FLAGS.items():
        if field in given and field.startswith("moe_") and not spec.is_moe:
            needs, why = "--num-experts", "this model has no experts"
        elif field in given and field in MLA_SIZES and not spec.multi_latent_attention:
            needs, why = "--multi-latent-attention", "this model would ignore it"
        else:
            continue
        raise ConfigError(f"{flag} {given[field]} has no effect without {needs} ({why}); add {needs} or drop {flag}")
    return spec


def moment_bytes_of(args) -> int | None:
    """Adam's moment bytes per element for --use-precision-aware-optimizer (None: fp32 Adam, 8); training's rules."""
    low = [flag for flag in ("--exp-avg-dtype", "--exp-avg-sq-dtype") if getattr(args, flag[2:].replace("-", "_")) != "fp32"]
    if low and not args.use_precision_aware_optimizer:
        raise ConfigError(f"{low[0]} bf16 needs --use-precision-aware-optimizer (as in training); add it or drop {low[0]}")
    return 8 - 2 * len(low) if low else None


def cluster_from_args(args) -> ClusterSpec:
    values = dict(CLUSTER_PRESETS[args.cluster])
    for flag in CLUSTER_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            values[flag[2:].replace("-", "_")] = value
    return ClusterSpec(gpus=args.gpus, **values)


def describe(best, spec: ModelSpec, cluster: ClusterSpec) -> str:
    """The best layout, its memory and its time broken down."""
    lay = best.layout
    comm = " + ".join(f"{k} {v:.3g}" for k, v in best.comm_s.items() if v)
    etp = f", ETP {lay.expert_tp}" if spec.is_moe else ""
    split = f", split {best.split}" if best.split else ""
    busiest = f", busiest stage {best.busiest:.3g}x the mean stage's FLOPs" if lay.pp > 1 else ""
    return (f"best: TP {lay.tp}, PP {lay.pp}, VPP {lay.vpp}{split}, DP {lay.dp}, CP {lay.cp}, EP {lay.ep}{etp}, "
            f"{('ZB-H1, ' if lay.vpp == 1 else 'zero bubble interleaved, ') if lay.schedule == 'zb-h1' else ''}ZeRO {lay.zero}{f' in {lay.instances} instances (hybrid)' if lay.instances > 1 else ''}, recompute {lay.recompute}, micro-batch {lay.micro_batch} "
            f"({best.num_microbatches} micro-batches per step)\n"
            f"  memory per GPU {figure(best.memory_gb)} of {cluster.gpu_memory_gb:g} GB: model state "
            f"{figure(best.model_state_gb)}, activations {figure(best.activation_gb)}, reserved "
            f"{figure(best.memory_gb - best.model_state_gb - best.activation_gb)}\n"
            f"  step {best.step_s:.3g} s: compute {best.compute_s:.3g} s at {MATMUL_EFFICIENCY:.0%} of peak, "
            f"communication {comm or 'none'} s, pipeline bubble {best.bubble:.1%}{busiest}\n"
            f"  {figure(best.tflops_per_gpu)} TFLOP/s per GPU, MFU {figure(100 * best.mfu)}%")


def draw(estimates, path: str, memory_gb: float) -> str:
    """Memory and step time of each layout as two bar charts; returns the line to print."""
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed: --png skipped (pip install matplotlib)"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"t{e.layout.tp} p{e.layout.pp}{'zb' if e.layout.schedule == 'zb-h1' else 'v'}{e.layout.vpp} d{e.layout.dp} c{e.layout.cp} e{e.layout.ep}"
              f"x{e.layout.expert_tp}\n"
              f"{e.layout.zero} {e.layout.recompute} b{e.layout.micro_batch}" for e in estimates]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(8, 0.6 * len(labels)), 7), sharex=True)
    x = range(len(labels))
    top.bar(x, [e.memory_gb for e in estimates], color=["tab:blue" if e.fits else "tab:red" for e in estimates])
    top.axhline(memory_gb, color="black", linestyle="--", linewidth=1, label=f"GPU memory {memory_gb:g} GB")
    top.set_ylabel("memory per GPU (GB)")
    top.legend(loc="lower right", fontsize=8)
    bottom.bar(x, [e.step_s for e in estimates], color="tab:green")
    bottom.set_ylabel("step time (s)")
    bottom.set_xticks(list(x), labels, rotation=90, fontsize=6)
    fig.tight_layout()
    try:
        save_figure(fig, path, flag="--png")
    finally:
        plt.close(fig)
    return f"wrote {path}"


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.png:
            check_output_file("--png", args.png)
        spec, cluster = model_from_args(args), cluster_from_args(args)
        fixed = {field: getattr(args, flag[2:].replace("-", "_")) for flag, (field, _, _) in LAYOUT_FLAGS.items()}
        fixed.update({field: getattr(args, name) for field, name in SPLIT_ARGS.items()})
        fixed["moment_bytes"] = moment_bytes_of(args)
        estimates = plan(spec, cluster, args.global_batch_size, {k: v for k, v in fixed.items() if v is not None})
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    dense, expert = stage_params(spec, 1, 1, 1, True, True)
    fitting = [e for e in estimates if e.fits]
    active = f" ({count(active_params(spec))} active)" if spec.is_moe else ""
    print(f"model: {count(dense + expert)} parameters{active}, {spec.num_layers} layers, hidden {spec.hidden_size}, "
          f"seq {spec.seq_length}; cluster: {cluster.gpus} GPUs ({cluster.gpus_per_node} per node, "
          f"{cluster.gpu_memory_gb:g} GB, {cluster.peak_tflops:g} TFLOP/s); global batch {args.global_batch_size}")
    print(f"{len(estimates)} layouts, {len(fitting)} fit in memory")
    shown = (fitting or sorted(estimates, key=lambda e: e.memory_gb))[:args.top]
    print(format_table(shown))
    if not fitting:
        print(f"no layout fits in {cluster.gpu_memory_gb:g} GB; the smallest needs {figure(shown[0].memory_gb)} GB")
    else:
        print(describe(fitting[0], spec, cluster))
    if args.png:
        try:
            print(draw(shown, args.png, cluster.gpu_memory_gb))
        except ConfigError as err:  # the write failed after the check (a full disk): nothing left behind
            print(f"error: {err}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
