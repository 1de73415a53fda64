"""Show a BERT checkpoint's top predictions for each [MASK] in a text, in one process.

The checkpoint may have been saved by pretrain_bert.py at any tensor- and pipeline-parallel size:
its shards are merged into a single-process BertModel (:mod:`megatron_lite.checkpoint.merge`). The
model shape comes from the config saved in the checkpoint; the tokenizer flags default to the saved
ones too (for a checkpoint converted from Hugging Face: the vocab.txt convert.py kept in its
``tokenizer`` folder): WordPiece, or Megatron's SentencePieceTokenizer (its appended [CLS]/[SEP]/[MASK]/[PAD]).

    python tools/fill_mask.py --load checkpoints/bert --text "the [MASK] statement" --top-k 5

The text is tokenized around the literal ``[MASK]`` markers and fed as ``[CLS] text [SEP]`` (one
segment, token type 0). For every mask the top-k tokens of the real vocabulary are printed with
their probabilities, then the text with each mask replaced by its best guess.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lite.checkpoint import CheckpointError, load_bert_checkpoint  # noqa: E402
from megatron_lite.checkpoint.hf_tokenizer import checkpoint_tokenizer  # noqa: E402
from megatron_lite.data.indexed_dataset import DataFileError  # noqa: E402
from megatron_lite.data.tokenizers import build_tokenizer  # noqa: E402
from megatron_lite.errors import OneLineParser, run_tool  # noqa: E402

MASK = "[MASK]"
# the tokenizers pretrain_bert.py trains with: those with [CLS]/[SEP]/[MASK]/[PAD] (Megatron's SentencePiece appends them)
MASK_TOKENIZERS = ("BertWordPieceLowerCase", "BertWordPieceCase", "SentencePieceTokenizer")


def parse_args(argv=None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--load", required=True, help="checkpoint save folder (latest iteration) or an iter_* folder")
    p.add_argument("--text", required=True, help=f"text with one or more {MASK} markers")
    p.add_argument("--top-k", type=int, default=5, help="predictions shown per mask")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    g = p.add_argument_group("tokenizer (default: the flags saved in the checkpoint)")
    g.add_argument("--tokenizer-type", default=None, choices=MASK_TOKENIZERS)
    g.add_argument("--vocab-file", default=None, help="vocab.txt (WordPiece)")
    g.add_argument("--tokenizer-model", default=None, help="the .model file (SentencePieceTokenizer)")
    args = p.parse_args(argv)
    if args.top_k < 1:
        p.error("--top-k must be at least 1")
    problem = device_problem(args.device)
    if problem:
        p.error(f"--device {args.device}: {problem}")
    return args


def device_problem(name: str) -> str | None:
    """Why ``--device`` cannot be used here (None when it can): not a device name, or no such CUDA device."""
    try:
        device = torch.device(name)
    except RuntimeError:
        return "not a device name; use cpu or cuda"
    if device.type not in ("cpu", "cuda"):
        return "use cpu or cuda"
    count = torch.cuda.device_count() if device.type == "cuda" and torch.cuda.is_available() else 0
    if device.type == "cuda" and (device.index or 0) >= count:
        return f"this machine has {count} CUDA device{'s' * (count != 1)}; use cpu" + (" or cuda" if count else "")
    return None


def encode(tokenizer, text: str) -> list[int]:
    """``[CLS] text [SEP]`` with every literal [MASK] as the mask id (the rest WordPiece-tokenized)."""
    ids = [tokenizer.cls]
    for i, part in enumerate(text.split(MASK)):
        if i > 0:
            ids.append(tokenizer.mask)
        ids.extend(tokenizer.tokenize(part.strip()) if part.strip() else [])  # a SentencePiece '▁' of its own otherwise
    return ids + [tokenizer.sep]


@torch.no_grad()
def predict(model, ids: list[int], mask_id: int, vocab_size: int, top_k: int, device="cpu") -> list[tuple[int, list]]:
    """For each mask position: (position, [(token id, probability)] best first) over the real vocabulary."""
    tokens = torch.tensor([ids], device=device)
    logits, _ = model(tokens, torch.ones_like(tokens), torch.zeros_like(tokens))
    probs = logits[0, :, :vocab_size].float().softmax(-1)
    out = []
    for pos, token in enumerate(ids):
        if token == mask_id:
            top = probs[pos].topk(min(top_k, vocab_size))
            out.append((pos, list(zip(top.indices.tolist(), top.values.tolist()))))
    return out


def build_tokenizer_for(args, saved: dict):
    if args.tokenizer_type is None and saved.get("tokenizer_type") is None:  # converted from Hugging Face
        saved = {**saved, **(checkpoint_tokenizer(args.load, bert=True) or {})}
    pick = lambda name: getattr(args, name) if getattr(args, name) is not None else saved.get(name)  # noqa: E731
    kind = pick("tokenizer_type")
    if kind not in MASK_TOKENIZERS:
        raise ValueError(f"the checkpoint's tokenizer {kind!r} is not a BERT WordPiece one; pass --tokenizer-type "
                         "BertWordPieceLowerCase and --vocab-file")
    return build_tokenizer(kind, vocab_file=pick("vocab_file"), tokenizer_model=pick("tokenizer_model"))


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        model, saved = load_bert_checkpoint(args.load)
        tokenizer = build_tokenizer_for(args, saved)
        if tokenizer.vocab_size > saved["padded_vocab_size"]:
            raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens but the checkpoint's vocabulary only "
                             f"{saved['padded_vocab_size']}; use the vocab the model was trained with")
        if MASK not in args.text:
            raise ValueError(f"--text has no {MASK} to fill in")
        ids = encode(tokenizer, args.text)
        limit = saved.get("max_position_embeddings") or saved["seq_length"]
        if len(ids) > limit:
            raise ValueError(f"--text is {len(ids)} tokens with [CLS] and [SEP]; the model takes at most {limit}")
    except (CheckpointError, DataFileError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    model.to(args.device)
    filled = list(ids)
    for pos, candidates in predict(model, ids, tokenizer.mask, tokenizer.vocab_size, args.top_k, args.device):
        shown = " | ".join(f"{tokenizer.detokenize([t])} {p:.3f}" for t, p in candidates)
        print(f"[MASK] at {pos}: {shown}")
        filled[pos] = candidates[0][0]
    print(tokenizer.detokenize(filled[1:-1]))
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
