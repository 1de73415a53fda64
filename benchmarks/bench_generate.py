"""Generation speed: the key/value cache vs full recompute, and our engine vs ``transformers`` generate.

One GPT-2-style model with random weights (default 4 layers, hidden 256, 8 heads, vocab 8192,
fp32, CPU unless --device cuda) is saved as a megatron_lite checkpoint and exported with
tools/checkpoint/convert.py to Hugging Face; both sides load it. From one 128-token prompt each generates 512 tokens greedily
(no early stop) in the same process, rounds alternating:

* ours with the cache: prefill time per prompt token, decode time per token, decode tokens/s;
* ours without the cache (every step recomputes the whole prefix): decode tokens/s; the ratio
  cached / uncached is the cache's speed-up (target >= 5x);
* ``transformers`` ``generate`` (its own cache) on the exported model: end-to-end tokens/s, and the
  ratio ours / transformers (goal >= 1.0); the two continuations are checked to be the same tokens.

Each run's time is printed as it finishes; the table gives medians over the rounds and the best
run (on a shared machine the best is the least disturbed). On a machine whose cores other jobs
share, ``--threads 1`` gives steadier figures: a decode step is hundreds of tiny operators, and with
2 threads each one waits for whichever thread was descheduled.

    python benchmarks/bench_generate.py [--rounds 2] [--threads 2] [--layers 4 --hidden 256 --vocab 8192] [--device cuda]

Needs ``pip install transformers safetensors``.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.common import OneLineParser, add_inference_model_args, describe_machine, positive_int  # noqa: E402


def parse_args(argv=None):
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    add_inference_model_args(p, rounds=2)
    p.add_argument("--prompt", type=positive_int, default=128, help="prompt tokens")
    p.add_argument("--new", type=positive_int, default=512, help="tokens to generate")
    p.add_argument("--skip-uncached", action="store_true", help="skip the (slow) full-recompute runs")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where both sides run (fp32)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no GPU is visible to torch here (run with --device cpu)")
    return args


def save_and_export(args, root: str) -> tuple[str, str]:
    from megatron_lite.checkpoint import save_checkpoint
    from megatron_lite.config import Config, ModelConfig
    from megatron_lite.models import GPTModel, TransformerConfig
    from megatron_lite.parallel.state import ParallelState
    from megatron_lite.parallel.tensor import padded_vocab_size
    from tests.tools import load_tool

    length = args.prompt + args.new
    model_cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                            seq_length=length, max_position_embeddings=length, vocab_size=args.vocab,
                            attention_dropout=0.0, hidden_dropout=0.0)
    model_cfg.padded_vocab_size = padded_vocab_size(args.vocab, 128, 1)
    state = ParallelState(world_size=1, rank=0)
    model = GPTModel(TransformerConfig.from_model(model_cfg, init_method_std=0.2), state)
    config = Config(model=model_cfg)
    config.data.tokenizer_type = "NullTokenizer"
    config.checkpoint.save = ckpt = os.path.join(root, "ckpt")
    save_checkpoint(1, [model], None, None, 0, config, state)
    hf = os.path.join(root, "hf")
    convert = load_tool("checkpoint/convert")
    if convert.main(["--model-type", "GPT", "--saver", "hf", "--load-dir", ckpt, "--save-dir", hf]) != 0:
        raise SystemExit("export to Hugging Face failed")
    return ckpt, hf


def run_ours(engine, prompt, new) -> dict:
    from megatron_lite.inference.sampling import SamplingParams

    start = time.perf_counter()
    out = engine.generate([prompt], SamplingParams(tokens_to_generate=new, top_k=1, stop_on_eod=False))[0]
    total = time.perf_counter() - start
    t = engine.timings
    return {"tokens": out.generated, "total_s": total, "prefill_s": t["prefill_s"], "decode_s": t["decode_s"],
            "decode_steps": t["decode_steps"]}


def run_hf(hf, prompt, new) -> dict:
    ids = torch.tensor([prompt], device=hf.device)
    start = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, pad_token_id=0)
    tokens = out[0, len(prompt):].tolist()  # (waits for the device)
    return {"tokens": tokens, "total_s": time.perf_counter() - start}


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    import transformers

    from megatron_lite.inference.engine import InferenceEngine
    from megatron_lite.inference.loading import load_model

    print(describe_machine(args.threads))
    print(f"model: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, vocab {args.vocab}, fp32 on "
          f"{args.device}; prompt {args.prompt} tokens, {args.new} new tokens, greedy, batch 1, "
          f"transformers {transformers.__version__}\n")
    with tempfile.TemporaryDirectory() as root:
        ckpt, hf_dir = save_and_export(args, root)
        model, _ = load_model(ckpt, device=torch.device(args.device))
        hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).to(args.device).eval()
    kw = dict(vocab_size=args.vocab, max_sequence_length=args.prompt + args.new)
    cached, full = InferenceEngine(model, **kw), InferenceEngine(model, use_cache=False, **kw)
    prompt = torch.randint(0, args.vocab - 1, (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    run_ours(cached, prompt, 8), run_hf(hf, prompt, 8)  # warm-up
    results = {"cached": [], "uncached": [], "hf": []}
    for r in range(args.rounds):
        order = [("cached", cached), ("hf", hf)] if r % 2 == 0 else [("hf", hf), ("cached", cached)]
        if not args.skip_uncached:
            order.append(("uncached", full))
        for name, runner in order:
            run = run_hf(runner, prompt, args.new) if name == "hf" else run_ours(runner, prompt, args.new)
            results[name].append(run)
            print(f"round {r + 1}/{args.rounds} {name}: {run['total_s']:.2f} s", flush=True)
    same = results["cached"][0]["tokens"] == results["hf"][0]["tokens"]
    med = lambda name, key: statistics.median(x[key] for x in results[name])  # noqa: E731
    decode_tps = lambda name: statistics.median(x["decode_steps"] / x["decode_s"] for x in results[name])  # noqa: E731
    best = lambda name: min(x["total_s"] for x in results[name])  # noqa: E731
    ours_tps, hf_tps = args.new / med("cached", "total_s"), args.new / med("hf", "total_s")
    print(f"{'':34s}{'tokens/s':>10s}{'total s':>10s}{'best s':>10s}")
    print(f"{'ours, KV cache (end to end)':34s}{ours_tps:10.1f}{med('cached', 'total_s'):10.2f}{best('cached'):10.2f}")
    print(f"{'transformers generate':34s}{hf_tps:10.1f}{med('hf', 'total_s'):10.2f}{best('hf'):10.2f}")
    print(f"\nours / transformers: {ours_tps / hf_tps:.2f}x median, {best('hf') / best('cached'):.2f}x best "
          f"(goal >= 1.0); same tokens: {same}")
    print(f"ours, KV cache: prefill {1e3 * med('cached', 'prefill_s') / args.prompt:.3f} ms per prompt token "
          f"({med('cached', 'prefill_s'):.3f} s for {args.prompt}), decode {1e3 / decode_tps('cached'):.2f} ms per "
          f"token ({decode_tps('cached'):.1f} tokens/s)")
    if results["uncached"]:
        ratio = decode_tps("cached") / decode_tps("uncached")
        print(f"ours, full recompute: decode {1e3 / decode_tps('uncached'):.2f} ms per token "
              f"({decode_tps('uncached'):.1f} tokens/s)")
        print(f"KV cache speed-up of decoding: {ratio:.1f}x (target >= 5x)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
