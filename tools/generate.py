"""Generate text from a megatron_lite GPT checkpoint, in one process or under torchrun.

The checkpoint may be ``torch`` or ``torch_dist`` and saved at any TP x PP (x EP) layout. Without
torchrun the model runs in one process; under torchrun it runs at the checkpoint's TP x PP (or the
``--tensor-model-parallel-size`` / ``--pipeline-model-parallel-size`` given). The engine keeps a
key/value cache (one token of work per new token), batches every ``--prompt`` together and stops a
sequence at the tokenizer's end-of-document token. The tokenizer flags default to the ones saved
in the checkpoint (for a checkpoint converted from Hugging Face: the tokenizer files convert.py kept
in its ``tokenizer`` folder). See docs/inference.md.

    python tools/generate.py --load checkpoints/gpt --prompt "The quick brown" --max-new-tokens 40 --greedy
    python tools/generate.py --load checkpoints/gpt --prompt "Once upon" --prompt "In 1900" --top-k 40 --seed 7
    torchrun --nproc-per-node 4 tools/generate.py --load checkpoints/gpt_tp2_pp2 --prompt "Hello" --log-probs
    python tools/generate.py --load checkpoints/mtp --prompt "Hello" --greedy --num-speculative-tokens 2

``--num-speculative-tokens N`` drafts N tokens per step with a model's multi-token prediction heads
(:mod:`megatron_lite.inference.speculative`), every prompt in one batch (each sequence keeps its own
number of drafts per step), in one process or under torchrun with tensor parallelism (no pipeline
parallelism), and prints the acceptance on stderr.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lite.errors import OneLineParser, run_tool  # noqa: E402
from megatron_lite.inference.cli import USER_ERRORS, add_inference_args, build_session, fail  # noqa: E402
from megatron_lite.inference.sampling import SamplingParams  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--prompt", action="append", default=None,
                   help="text to continue; repeat for a batch (none: start from the end-of-document token)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate at most per prompt")
    p.add_argument("--greedy", action="store_true", help="always take the most likely token (same as --top-k 1)")
    p.add_argument("--temperature", type=float, default=1.0, help="softmax temperature; 0 means greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all; 1: greedy)")
    p.add_argument("--top-p", type=float, default=0.0, help="sample among the most likely tokens adding up to p")
    p.add_argument("--log-probs", action="store_true", help="also print every token with its log-prob")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="speculative decoding (vLLM's name): draft this many tokens per step with the model's "
                        "multi-token prediction heads (at most its --mtp-num-layers) and verify them in one "
                        "forward pass; the same distribution (greedy: the same tokens); several --prompt run as "
                        "one batch")
    add_inference_args(p)
    args = p.parse_args(argv)
    if args.max_new_tokens < 0:
        p.error("--max-new-tokens must be >= 0")
    if args.temperature < 0:
        p.error("--temperature must be >= 0")
    if args.num_speculative_tokens is not None and args.num_speculative_tokens < 1:
        p.error(f"--num-speculative-tokens {args.num_speculative_tokens} must be at least 1 (or left out)")
    return args


def sampling_params(args) -> SamplingParams:
    greedy = args.greedy or args.temperature == 0
    params = SamplingParams(tokens_to_generate=args.max_new_tokens, temperature=args.temperature or 1.0,
                            top_k=1 if greedy else args.top_k, top_p=0.0 if greedy else args.top_p)
    params.check()
    return params


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The prompt's tokens; an empty prompt starts from the end-of-document token."""
    ids = tokenizer.tokenize(prompt) if prompt else []
    if not ids:
        if tokenizer.eod is None:
            raise ValueError("empty --prompt and the tokenizer has no end-of-document token to start from")
        ids = [tokenizer.eod]
    return ids


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        params = sampling_params(args)
        session = build_session(args)
        tok = session.tokenizer
        texts = args.prompt or [""]
        results = session.engine.generate([prompt_ids(tok, t) for t in texts], params)
    except USER_ERRORS as err:
        return fail(err)
    if not session.is_rank0:
        return 0
    for text, result in zip(texts, results):
        start = result.prompt_length if not text else 0
        print(tok.detokenize(result.tokens[start:]))
        if args.log_probs:
            for token, logp in zip(result.tokens[1:], result.log_probs):
                print(f"  {token:>8d} {logp:10.4f}  {tok.detokenize([token])!r}")
    if args.num_speculative_tokens:
        print(acceptance_line(session.engine.served, args.num_speculative_tokens), file=sys.stderr)
    return 0


def acceptance_line(timings: dict, num_tokens: int) -> str:
    """The speculative decoder's acceptance: tokens per verify step and drafts kept."""
    steps, drafted = timings.get("verify_steps", 0), timings.get("drafted", 0)
    per_step = timings.get("tokens", 0) / steps if steps else 0.0
    kept = f"{timings.get('accepted', 0)} of {drafted} drafts accepted" + (
        f" ({100 * timings.get('accepted', 0) / drafted:.0f}%)" if drafted else "")
    return (f"speculative decoding ({num_tokens} token(s) per draft): {per_step:.2f} tokens per verify step over "
            f"{steps} verify step(s), {kept}")


if __name__ == "__main__":
    sys.exit(run_tool(main))
