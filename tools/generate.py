"""Sample text from a megatron_lite GPT checkpoint in one process.

The checkpoint may have been saved at any tensor- and pipeline-parallel size: its shards are
merged into a single-process GPTModel (:mod:`megatron_lite.checkpoint.merge`). The model shape comes
from the config saved in the checkpoint; the tokenizer flags default to the saved ones too (for a
checkpoint converted from Hugging Face: the tokenizer files convert.py kept in its ``tokenizer`` folder).

    python tools/generate.py --load checkpoints/gpt --prompt "The quick brown" --max-new-tokens 40 --greedy
    python tools/generate.py --load checkpoints/gpt --prompt "Once upon" --temperature 0.8 --top-k 40 --seed 7

Generation recomputes the whole context for every new token (no key/value cache): simple, and fast
enough for the small models this tool is meant to inspect. The context is cut to the last
max-position-embeddings (learned) or seq-length (rope) tokens. Sampling stops at the tokenizer's
end-of-document token.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lite.checkpoint import CheckpointError, load_gpt_checkpoint  # noqa: E402
from megatron_lite.checkpoint.hf_tokenizer import checkpoint_tokenizer  # noqa: E402
from megatron_lite.data.indexed_dataset import DataFileError  # noqa: E402
from megatron_lite.data.tokenizers import TOKENIZER_TYPES, build_tokenizer  # noqa: E402
from megatron_lite.errors import OneLineParser  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--load", required=True, help="checkpoint save folder (latest iteration) or an iter_* folder")
    p.add_argument("--prompt", default="", help="text to continue (empty: start from the end-of-document token)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate at most")
    p.add_argument("--greedy", action="store_true", help="always take the most likely token (same as --temperature 0)")
    p.add_argument("--temperature", type=float, default=1.0, help="softmax temperature; 0 means greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample only among the k most likely tokens (0: all)")
    p.add_argument("--seed", type=int, default=1234, help="seed of the sampling generator")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    g = p.add_argument_group("tokenizer (default: the flags saved in the checkpoint)")
    g.add_argument("--tokenizer-type", default=None, choices=TOKENIZER_TYPES)
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer vocabulary size")
    args = p.parse_args(argv)
    if args.max_new_tokens < 0:
        p.error("--max-new-tokens must be >= 0")
    if args.temperature < 0:
        p.error("--temperature must be >= 0")
    if args.top_k < 0:
        p.error("--top-k must be >= 0")
    return args


def context_limit(config: dict) -> int:
    if config.get("position_embedding_type", "learned_absolute") == "learned_absolute":
        return config.get("max_position_embeddings") or config["seq_length"]
    return config["seq_length"]


@torch.no_grad()
def next_token_logits(model, ids: list[int], vocab_size: int, limit: int, device="cpu") -> torch.Tensor:
    """Logits of the token after ``ids`` over the real vocabulary (the padded tail is cut off)."""
    context = torch.tensor([ids[-limit:]], dtype=torch.long, device=device)
    return model(context)[0, -1, :vocab_size].float()


def generate(model, prompt_ids: list[int], max_new_tokens: int, *, vocab_size: int, limit: int,
             temperature: float = 0.0, top_k: int = 0, eod: int | None = None, seed: int = 1234,
             device="cpu") -> list[int]:
    """The new token ids: greedy when ``temperature == 0``, else sampled from softmax(logits / T),
    restricted to the ``top_k`` most likely tokens when ``top_k > 0``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    ids, new = list(prompt_ids), []
    for _ in range(max_new_tokens):
        logits = next_token_logits(model, ids, vocab_size, limit, device)
        if temperature == 0:
            token = int(logits.argmax())
        else:
            logits = logits / temperature
            if 0 < top_k < logits.numel():
                kth = logits.topk(top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            token = int(torch.multinomial(logits.softmax(-1), 1, generator=gen))
        ids.append(token)
        new.append(token)
        if eod is not None and token == eod:
            break
    return new


def build_tokenizer_for(args, saved: dict):
    """The tokenizer from the flags, each flag defaulting to the value saved in the checkpoint."""
    if args.tokenizer_type is None and saved.get("tokenizer_type") is None:  # converted from Hugging Face
        saved = {**saved, **(checkpoint_tokenizer(args.load) or {})}
    pick = lambda name: getattr(args, name) if getattr(args, name) is not None else saved.get(name)  # noqa: E731
    kind = pick("tokenizer_type")
    if kind is None:
        raise ValueError("the checkpoint names no tokenizer and holds no tokenizer folder; pass --tokenizer-type "
                         "and its files")
    return build_tokenizer(kind, vocab_file=pick("vocab_file"), merge_file=pick("merge_file"),
                           tokenizer_model=pick("tokenizer_model"), vocab_size=pick("vocab_size"))


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        model, saved = load_gpt_checkpoint(args.load)
        tokenizer = build_tokenizer_for(args, saved)
        padded = saved["padded_vocab_size"]
        if tokenizer.vocab_size > padded:
            raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens but the checkpoint's vocabulary only "
                             f"{padded}; use the tokenizer the model was trained with")
        prompt = tokenizer.tokenize(args.prompt) if args.prompt else []
        if not prompt:
            if tokenizer.eod is None:
                raise ValueError("empty --prompt and the tokenizer has no end-of-document token to start from")
            prompt = [tokenizer.eod]
    except (CheckpointError, DataFileError, ValueError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    model.to(args.device)
    temperature = 0.0 if args.greedy else args.temperature
    vocab = min(saved.get("vocab_size") or tokenizer.vocab_size, padded)
    new = generate(model, prompt, args.max_new_tokens, vocab_size=vocab, limit=context_limit(saved),
                   temperature=temperature, top_k=args.top_k, eod=tokenizer.eod, seed=args.seed,
                   device=args.device)
    print(tokenizer.detokenize((prompt if args.prompt else []) + new))
    return 0


if __name__ == "__main__":
    sys.exit(main())
