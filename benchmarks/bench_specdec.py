"""Speculative decoding with the model's own MTP heads: tokens/s with and without it, and the acceptance.

A tiny rotary GPT with ``--depths`` multi-token prediction depths (default 4 layers, hidden 128, 4
heads, vocabulary 256, 2 depths) is trained here, in one process, for ``--steps`` steps on a
repetitive corpus: windows of a few fixed random token cycles, a fraction ``--noise`` of the tokens
replaced at random, so that the main head and the MTP heads learn to agree on the continuation
(as a trained DeepSeek-V3's do on most text). Then from ``--prompts`` prompts (windows of the cycles)
it generates ``--new`` tokens each (no early stop), rounds alternating between:

* plain decoding (one token per forward pass of the main model);
* speculative decoding with 1 .. ``--depths`` drafts per step (tools/generate.py's
  ``--num-speculative-tokens``): greedy, whose tokens are checked to be plain greedy decoding's, and
  sampled at temperature 1 with the largest number of drafts.

It prints, side by side, decode tokens/s (median over rounds), the speed-up over plain decoding (median
and best round), tokens per second of the process's CPU time (steadier where other jobs share the
cores), the tokens per verify step and the share of drafts accepted, then the decode tokens/s of one
batch of ``--batch`` prompts (default 4: every sequence's drafts verified in one forward pass against
the plain engine's static batch) and its speed-up. fp32, CPU unless ``--device cuda``.

    python benchmarks/bench_specdec.py [--steps 300] [--depths 2] [--new 128] [--rounds 5] [--batch 4] [--threads 2]
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.common import OneLineParser, describe_machine, positive_int, probability  # noqa: E402


def parse_args(argv=None):
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=positive_int, default=300, help="training steps")
    p.add_argument("--depths", type=positive_int, default=2, help="MTP depths (--mtp-num-layers)")
    p.add_argument("--layers", type=positive_int, default=4)
    p.add_argument("--hidden", type=positive_int, default=128)
    p.add_argument("--heads", type=positive_int, default=4)
    p.add_argument("--vocab", type=positive_int, default=256)
    p.add_argument("--cycles", type=positive_int, default=4, help="distinct token cycles in the corpus")
    p.add_argument("--noise", type=probability, default=0.05, help="share of corpus tokens replaced at random")
    p.add_argument("--prompts", type=positive_int, default=2, help="prompts, each generated from once per round")
    p.add_argument("--new", type=positive_int, default=128, help="tokens generated per prompt")
    p.add_argument("--rounds", type=positive_int, default=5)
    p.add_argument("--batch", type=positive_int, default=4, help="prompts of the batch column, generated together")
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = p.parse_args(argv)
    if args.new < 2:
        p.error(f"--new {args.new}: at least 2 (the first new token comes from the prefill, the rest are decoded)")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no GPU is visible to torch here (run with --device cpu)")
    return args


SEQ = 64  # training window


def build(args):
    from megatron_lite.config import ModelConfig
    from megatron_lite.models import GPTModel, TransformerConfig
    from megatron_lite.parallel.state import ParallelState
    from megatron_lite.parallel.tensor import padded_vocab_size

    cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                      seq_length=SEQ, max_position_embeddings=SEQ, vocab_size=args.vocab,
                      position_embedding_type="rope", normalization="RMSNorm", swiglu=True, disable_bias_linear=True,
                      attention_dropout=0.0, hidden_dropout=0.0, mtp_num_layers=args.depths)
    cfg.padded_vocab_size = padded_vocab_size(args.vocab, 128, 1)
    torch.manual_seed(0)
    return GPTModel(TransformerConfig.from_model(cfg), ParallelState(world_size=1, rank=0)).to(args.device)


def corpus(args, g):
    """The token cycles (lengths 37, 41, 43, ...: each window shows where it is in its cycle)."""
    return [torch.randint(0, args.vocab, (37 + 4 * i,), generator=g) for i in range(args.cycles)]


def window(cycles, length, g, noise=0.0) -> torch.Tensor:
    cycle = cycles[int(torch.randint(0, len(cycles), (1,), generator=g))]
    start = int(torch.randint(0, len(cycle), (1,), generator=g))
    tokens = cycle.repeat(length // len(cycle) + 2)[start:start + length].clone()
    if noise:
        swap = torch.rand(length, generator=g) < noise
        tokens[swap] = torch.randint(0, int(cycle.max()) + 1, (int(swap.sum()),), generator=g)
    return tokens


def train(model, args, cycles) -> float:
    """``--steps`` Adam steps on batches of 16 noisy windows; returns the last main loss."""
    from megatron_lite.models.mtp import mtp_targets

    g = torch.Generator().manual_seed(1)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for step in range(args.steps):
        batch = torch.stack([window(cycles, SEQ + 1, g, args.noise) for _ in range(16)]).to(args.device)
        tokens, labels = batch[:, :-1], batch[:, 1:]
        mtp = mtp_targets(tokens, labels, torch.ones_like(tokens, dtype=torch.float), args.depths)
        losses = model(tokens, labels=labels, mtp_tokens=mtp["mtp_tokens"], mtp_labels=mtp["mtp_labels"])
        mask = torch.cat([torch.ones_like(losses[:1]), mtp["mtp_loss_mask"]])  # the last k of depth k: no target
        per_head = (losses * mask).sum(dim=(1, 2)) / mask.sum(dim=(1, 2))
        loss = per_head[0] + per_head[1:].mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == args.steps - 1:
            heads = " ".join(f"{v:.3f}" for v in per_head.tolist())
            print(f"step {step + 1:4d}: loss per head (main, MTP 1..{args.depths}) {heads}", flush=True)
    model.eval()
    return float(per_head[0].detach())


def run(engine, prompts, new, greedy: bool) -> dict:
    from megatron_lite.inference.sampling import SamplingParams

    params = SamplingParams(tokens_to_generate=new, top_k=1 if greedy else 0, stop_on_eod=False, random_seed=5)
    out = {"tokens": [], "decode_s": 0.0, "steps": 0, "drafted": 0, "accepted": 0, "emitted": 0}
    for prompt in prompts:
        cpu = time.process_time()
        out["tokens"].append(engine.generate([prompt], params)[0].tokens)
        out["cpu_s"] = out.get("cpu_s", 0.0) + time.process_time() - cpu
        t = engine.timings
        out["decode_s"] += t["decode_s"]
        out["steps"] += t["decode_steps"]
        for key, src in (("drafted", "drafted"), ("accepted", "accepted"), ("emitted", "tokens")):
            out[key] += t.get(src, 0)
    out["tps"] = len(prompts) * (new - 1) / out["decode_s"]  # the tokens after the prefill's
    out["cpu_tps"] = len(prompts) * new / out["cpu_s"]  # prefill included; this process's CPU time only
    return out


def run_batch(engine, prompts, new, greedy: bool) -> dict:
    """One batch of ``prompts`` generated together: its decode tokens/s and its tokens."""
    from megatron_lite.inference.sampling import SamplingParams

    params = SamplingParams(tokens_to_generate=new, top_k=1 if greedy else 0, stop_on_eod=False, random_seed=5)
    tokens = [g.tokens for g in engine.generate(prompts, params)]
    return {"tps": len(prompts) * (new - 1) / engine.timings["decode_s"], "tokens": tokens}


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from megatron_lite.inference.engine import InferenceEngine
    from megatron_lite.inference.speculative import SpeculativeEngine

    print(describe_machine(args.threads))
    print(f"model: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, vocab {args.vocab}, "
          f"{args.depths} MTP depths, fp32 on {args.device}; {args.steps} training steps on {args.cycles} cycles "
          f"(noise {args.noise}); {args.prompts} prompts x {args.new} new tokens, batch 1\n")
    g = torch.Generator().manual_seed(0)
    cycles = corpus(args, g)
    model = build(args)
    start = time.perf_counter()
    train(model, args, cycles)
    print(f"trained in {time.perf_counter() - start:.1f} s\n")
    prompts = [window(cycles, 24, g).tolist() for _ in range(max(args.prompts, args.batch))]
    batch, prompts = prompts[:args.batch], prompts[:args.prompts]
    kw = dict(vocab_size=args.vocab, max_sequence_length=24 + args.new)
    runs = [("plain, greedy", InferenceEngine(model, **kw), True)]
    runs += [(f"N={n}, greedy", SpeculativeEngine(model, num_speculative_tokens=n, **kw), True)
             for n in range(1, args.depths + 1)]
    runs += [("plain, T=1", InferenceEngine(model, **kw), False),
             (f"N={args.depths}, T=1", SpeculativeEngine(model, num_speculative_tokens=args.depths, **kw), False)]
    for _, engine, greedy in runs:
        run(engine, prompts[:1], min(8, args.new), greedy)  # warm-up
    results = {name: [] for name, _, _ in runs}
    batched = {name: [] for name, _, _ in runs}
    for r in range(args.rounds):
        for name, engine, greedy in (runs if r % 2 == 0 else runs[::-1]):
            results[name].append(run(engine, prompts, args.new, greedy))
            batched[name].append(run_batch(engine, batch, args.new, greedy))
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    reference = results["plain, greedy"][0]["tokens"]
    same = all(results[name][0]["tokens"] == reference for name, _, greedy in runs if greedy)
    same_batch = all(batched[name][0]["tokens"] == batched["plain, greedy"][0]["tokens"] for name, _, greedy in runs
                     if greedy)
    print(f"\n{'':16s}{'tokens/s':>10s}{'speed-up':>10s}{'best':>8s}{'per CPU s':>11s}{'speed-up':>10s}"
          f"{'tokens/verify':>15s}{'drafts kept':>13s}{f'batch {args.batch} t/s':>14s}{'speed-up':>10s}")
    for name, _, greedy in runs:
        base = "plain, greedy" if greedy else "plain, T=1"
        tps, base_tps = (statistics.median(x["tps"] for x in results[k]) for k in (name, base))
        best, base_best = (max(x["tps"] for x in results[k]) for k in (name, base))
        cpu, base_cpu = (statistics.median(x["cpu_tps"] for x in results[k]) for k in (name, base))
        last = results[name][-1]
        per_step = f"{last['emitted'] / last['steps']:.2f}" if last["drafted"] else "1.00"
        kept = f"{100 * last['accepted'] / last['drafted']:.0f}%" if last["drafted"] else "-"
        together, base_together = (statistics.median(x["tps"] for x in batched[k]) for k in (name, base))
        print(f"{name:16s}{tps:10.1f}{tps / base_tps:9.2f}x{best / base_best:7.2f}x{cpu:11.1f}{cpu / base_cpu:9.2f}x"
              f"{per_step:>15s}{kept:>13s}{together:14.1f}{together / base_together:9.2f}x")
    print("(tokens/s: decode, median over rounds; speed-up: against plain decoding, median and best round; "
          "per CPU s: tokens per second of this process's CPU time, steadier on a shared machine; batch: the "
          f"decode tokens/s of {args.batch} prompts generated together, median over rounds)")
    print(f"\ngreedy with drafts = plain greedy, token for token: {same} (batch of {args.batch}: {same_batch})")
    return 0 if same and same_batch else 1


if __name__ == "__main__":
    sys.exit(main())
