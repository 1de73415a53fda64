"""Single-process training throughput: megatron_lite's GPTModel vs Hugging Face GPT2LMHeadModel.

Identical configuration for both (6 layers, hidden 768, 12 heads, seq 512, vocab 32768, batch 4,
fp32, CPU, 2 threads, the same dropout, tied embeddings, learned positions, biases), random
initialisation (nothing is downloaded), one training step = forward with labels, mean loss,
backward, ``torch.optim.AdamW`` step, zero grads. Both models live in this one process; after a
warm-up the steps alternate A B B A ... so machine drift hits both alike. Reports s/step,
tokens/s, the ratio ours/HF (target >= 1.0), achieved FLOP/s from the Narayanan formula and its
fraction of this machine's measured fp32 matmul peak.

    python benchmarks/bench_train_vs_hf.py [--rounds 4] [--threads 2] [--dropout 0.1] [--profile]

Needs ``pip install transformers``.
"""

from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.common import OneLineParser, describe_machine, positive_int, probability, timed  # noqa: E402
from megatron_lite.perf.flops import num_floating_point_operations  # noqa: E402
from megatron_lite.perf.matmul_peak import measure_matmul_peak  # noqa: E402

LAYERS, HIDDEN, HEADS, SEQ, VOCAB, BATCH = 6, 768, 12, 512, 32768, 4


def build_ours(dropout: float):
    from megatron_lite.models import GPTModel, TransformerConfig
    from megatron_lite.parallel.random import model_parallel_seed
    from megatron_lite.parallel.state import ParallelState

    cfg = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, seq_length=SEQ,
        vocab_size=VOCAB, attention_dropout=dropout, hidden_dropout=dropout,
    )
    state = ParallelState()
    model_parallel_seed(1234, state)
    model = GPTModel(cfg, state).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(tokens, labels):
        loss = model(tokens, labels=labels).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return cfg, model, step


def build_hf(dropout: float):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_inner=4 * HIDDEN,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, attn_implementation="sdpa",
        bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1,
    )
    model = GPT2LMHeadModel(cfg).train()
    if model.config._attn_implementation != "sdpa":
        raise RuntimeError(f"HF model uses {model.config._attn_implementation!r} attention, expected sdpa")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(tokens, labels):
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return model, step


def profile_step(name, step, tokens, labels, rows=25):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step(tokens, labels)
    print(f"\n=== profile of one {name} step (top {rows} ops by self CPU time) ===")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=50))
    print(f"=== {name}: same, grouped by input shape (top 15) ===")
    print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=15,
                                                             max_name_column_width=40, max_shapes_column_width=60))


def main(argv=None):
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=positive_int, default=6, help="timed A/B pairs after warm-up")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps of each model first")
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument("--dropout", type=probability, default=0.1, help="attention, hidden and embedding dropout (both)")
    p.add_argument("--profile", action="store_true", help="also profile one step of each with torch.profiler")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(describe_machine(args.threads))
    import transformers

    print(f"transformers {transformers.__version__}")
    print(f"config: {LAYERS} layers, hidden {HIDDEN}, {HEADS} heads, seq {SEQ}, vocab {VOCAB}, batch {BATCH}, "
          f"fp32, AdamW, dropout {args.dropout}, HF attention sdpa")
    peak_before = measure_matmul_peak(n=2048)

    cfg, ours, ours_step = build_ours(args.dropout)
    hf, hf_step = build_hf(args.dropout)
    n_ours = sum(p.numel() for p in ours.parameters())
    n_hf = sum(p.numel() for p in hf.parameters())
    print(f"parameters: ours {n_ours:,}, HF {n_hf:,}")
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    labels = torch.roll(tokens, -1, dims=1)

    for _ in range(args.warmup):
        ours_step(tokens, labels)
        hf_step(tokens, labels)
    times = {"ours": [], "hf": []}
    steps = {"ours": ours_step, "hf": hf_step}
    for r in range(args.rounds):
        order = ("ours", "hf") if r % 2 == 0 else ("hf", "ours")  # A B, B A, ...
        for name in order:
            times[name].append(timed(lambda s=steps[name]: s(tokens, labels)))
        print(f"round {r + 1}: ours {times['ours'][-1]:.3f} s, HF {times['hf'][-1]:.3f} s", flush=True)
    peak_after = measure_matmul_peak(n=2048)
    peak = max(peak_before, peak_after)

    flops = num_floating_point_operations(cfg, BATCH)
    print(f"\nmodel FLOPs per step (72Bslh^2(1+s/6h+V/12lh)): {flops / 1e12:.3f} TFLOP")
    print(f"fp32 matmul peak (n=2048, {args.threads} threads): {peak_before / 1e9:.1f} GFLOP/s before, "
          f"{peak_after / 1e9:.1f} after; using {peak / 1e9:.1f}")
    print(f"{'':6} {'s/step (median)':>16} {'min':>8} {'max':>8} {'tokens/s':>10} {'GFLOP/s':>9} {'of peak':>8}")
    med = {}
    for name, label in (("ours", "ours"), ("hf", "HF")):
        t = times[name]
        med[name] = statistics.median(t)
        print(f"{label:6} {med[name]:16.3f} {min(t):8.3f} {max(t):8.3f} {BATCH * SEQ / med[name]:10.1f} "
              f"{flops / med[name] / 1e9:9.1f} {flops / med[name] / peak:8.1%}")
    print(f"\nthroughput ratio ours/HF (median step times): {med['hf'] / med['ours']:.3f}  (target >= 1.0)")
    print(f"ratio of the best (minimum) step times, the least disturbed by other load: "
          f"{min(times['hf']) / min(times['ours']):.3f}")
    paired = [h / o for o, h in zip(times["ours"], times["hf"])]
    print(f"per-round ratios: {', '.join(f'{x:.3f}' for x in paired)}")

    if args.profile:
        profile_step("ours", ours_step, tokens, labels)
        profile_step("HF", hf_step, tokens, labels)


if __name__ == "__main__":
    main()
