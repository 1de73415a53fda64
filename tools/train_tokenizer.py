"""Train a tokenizer on local text: SentencePiece (.model), GPT-2-style byte-level BPE (vocab/merges)
or a BERT WordPiece vocab.txt.

    # SentencePiece BPE, 4096 pieces, from the "text" field of a JSONL file -> data/spm4k.model/.vocab
    python tools/train_tokenizer.py --input data/sample.jsonl --output-prefix data/spm4k --vocab-size 4096

    # GPT-2 byte-level BPE -> data/gpt2-vocab.json + data/gpt2-merges.txt (for GPT2BPETokenizer)
    python tools/train_tokenizer.py --input data/sample.jsonl --output-prefix data/gpt2 \\
        --model-type byte-level-bpe --vocab-size 8192

    # BERT WordPiece -> data/bert-vocab.txt ([PAD] [UNK] [CLS] [SEP] [MASK] first; for BertWordPieceLowerCase)
    python tools/train_tokenizer.py --input data/sample.jsonl --output-prefix data/bert \\
        --model-type wordpiece --vocab-size 4096

Input is JSONL (``--json-keys`` fields, default "text") when the file name ends in .jsonl/.json
(optionally .gz), else plain text (one training sentence per line).  The SentencePiece defaults
suit a small corpus and make decoding exact: identity normalization, whitespace kept as is,
byte fallback (unseen characters become byte pieces, never <unk>), digits split, ids
unk=0 bos=1 eos=2 (eos is GPTSentencePieceTokenizer's EOD).
"""

import argparse
import gzip
import json
import os
import re
import sys
import zlib

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lite.data.input_paths import compressed_hint, output_prefix  # noqa: E402
from megatron_lite.errors import OneLineParser, run_tool  # noqa: E402


def read_texts(path: str, json_keys=("text",), jsonl=None):
    """Yield the training texts of a JSONL or plain-text file (see the module docstring)."""
    if jsonl is None:
        jsonl = path.removesuffix(".gz").endswith((".jsonl", ".json"))
    opener = gzip.open if path.endswith(".gz") else open
    # utf-8-sig: a byte-order mark (files saved by Windows tools) is not text; preprocess_data.py skips it too
    with opener(path, "rt", encoding="utf-8-sig") as f:
        try:
            yield from _texts_of(f, path, json_keys, jsonl)
        except UnicodeDecodeError as e:
            hint = "" if path.endswith(".gz") else compressed_hint(path)  # a .bz2, .zst, .xz: not a text encoding
            raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start} of a block)"
                             + (hint or "; convert it to UTF-8")) from None


def _texts_of(f, path, json_keys, jsonl):
    """The texts of an open text file, line by line (JSONL fields or whole lines), made UTF-8-encodable
    as the tokenizers read them (a JSON "\\ud83d" escape: U+FFFD)."""
    from megatron_lite.data.tokenizers import encodable

    for text in _raw_texts_of(f, path, json_keys, jsonl):
        yield encodable(text)


def _raw_texts_of(f, path, json_keys, jsonl):
    for lineno, line in enumerate(f, 1):
        if not line.strip():
            continue
        if not jsonl:
            yield line.rstrip("\n")
            continue
        try:
            obj = json.loads(line)
            texts = [obj[k] for k in json_keys]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{lineno}: not a JSON object with keys {list(json_keys)} ({e})") from None
        for key, text in zip(json_keys, texts):
            # as tools/preprocess_data.py reads them: a string, or a list of strings (the sentences)
            if isinstance(text, list) and all(isinstance(t, str) for t in text):
                yield from text
            elif isinstance(text, str):
                yield text
            else:
                raise ValueError(f"{path}:{lineno}: value of {key!r} is {type(text).__name__}, not a string or a "
                                 "list of strings")


def _read_all(path: str, json_keys) -> list:
    """Every text of ``path``; a .gz that is cut short, corrupt or not gzip at all (or an unreadable file)
    is a ValueError naming the file, not a traceback."""
    try:
        return list(read_texts(path, json_keys))
    except (OSError, EOFError, zlib.error) as e:
        what = "compressed input is damaged or not gzip" if path.endswith(".gz") else "cannot be read"
        raise ValueError(f"{path}: {what} ({e}); re-create or re-download it (--input)") from None


def train_sentencepiece(texts, output_prefix: str, vocab_size: int = 4096, model_type: str = "bpe",
                        verbose: bool = False) -> str:
    """Train on ``texts`` (each split into lines); returns the .model path."""
    import sentencepiece as spm

    texts = list(texts)

    def lines():
        for text in texts:
            for line in text.split("\n"):
                if line.strip():
                    yield line

    minimum = sentencepiece_minimum(texts)
    if vocab_size < minimum:
        raise ValueError(f"--vocab-size {vocab_size} is too small for this corpus: SentencePiece with byte fallback "
                         f"needs at least {minimum} pieces (3 special + 256 bytes + its {minimum - 259} distinct "
                         "characters); raise --vocab-size")
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    try:
        _train_sentencepiece(spm, lines(), output_prefix, vocab_size, model_type, verbose)
    except RuntimeError as err:  # SentencePiece's own check, in its words: say it in ours
        limit = re.search(r"too high \((\d+)\)\. Please set it to a value <= (\d+)", str(err))
        if limit:
            raise ValueError(f"--vocab-size {vocab_size} is more than {model_type} can learn from this corpus "
                             f"(at most {limit.group(2)}); lower --vocab-size or give more text") from None
        raise
    return output_prefix + ".model"


def sentencepiece_minimum(texts) -> int:
    """The smallest --vocab-size SentencePiece accepts here: unk/bos/eos, the 256 byte-fallback
    pieces, and every distinct character (character coverage 1.0; a space is its meta symbol)."""
    chars = set()
    for text in texts:
        for line in text.split("\n"):
            if line.strip():
                chars.update(line.replace(" ", "\u2581"))
    return 3 + 256 + len(chars)


def _train_sentencepiece(spm, lines, output_prefix, vocab_size, model_type, verbose) -> None:
    spm.SentencePieceTrainer.train(
        sentence_iterator=lines, model_prefix=output_prefix, vocab_size=vocab_size,
        model_type=model_type, character_coverage=1.0, byte_fallback=True, split_digits=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        max_sentence_length=1 << 16, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        num_threads=1, minloglevel=0 if verbose else 2,
    )


def train_byte_level_bpe(texts, output_prefix: str, vocab_size: int, min_frequency: int = 2):
    """GPT-2 format files ``{prefix}-vocab.json`` and ``{prefix}-merges.txt``; returns their paths."""
    from megatron_lite.data.gpt2_bpe import save_vocab_and_merges, train_gpt2_bpe

    if vocab_size < 257:
        raise ValueError(f"--vocab-size {vocab_size} is too small for byte-level-bpe: the 256 byte symbols and "
                         "<|endoftext|> take 257 (and 257 learns no merge); give more")
    encoder, merges = train_gpt2_bpe(texts, vocab_size, min_frequency)
    vocab_file, merge_file = f"{output_prefix}-vocab.json", f"{output_prefix}-merges.txt"
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    save_vocab_and_merges(encoder, merges, vocab_file, merge_file)
    return vocab_file, merge_file


def train_wordpiece_vocab(texts, output_prefix: str, vocab_size: int, lower_case: bool, min_frequency: int = 2):
    """BERT's ``{prefix}-vocab.txt``; returns its path."""
    from megatron_lite.data.wordpiece import save_vocab, train_wordpiece

    vocab = train_wordpiece(texts, vocab_size, lower_case, min_frequency)
    if len(vocab) > vocab_size:  # the trainer keeps every character coverable: more than was asked for
        raise ValueError(f"--vocab-size {vocab_size} is too small for wordpiece on this corpus: the 5 special tokens "
                         f"and its characters (each also as a ##continuation) take {len(vocab)}; give at least that")
    path = f"{output_prefix}-vocab.txt"
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    save_vocab(vocab, path)
    return path


def _say_if_short(vocab_file: str, asked: int) -> None:
    """Byte-level BPE stops when no pair occurs --min-frequency times: say so when that cut it short."""
    with open(vocab_file, encoding="utf-8-sig") as f:
        size = len(json.load(f))
    if size < asked:
        print(f"note: {size} tokens, not --vocab-size {asked}: no further pair occurs --min-frequency times "
              "in this corpus")


def _check_model_flags(parser, args) -> None:
    """--min-frequency and --cased are refused (exit 2) where --model-type would ignore them."""
    own = args.model_type in ("byte-level-bpe", "wordpiece")
    if args.min_frequency is not None and not own:
        parser.error(f"--min-frequency is for --model-type byte-level-bpe or wordpiece; SentencePiece "
                     f"{args.model_type} has no such setting: drop it")
    if args.min_frequency is not None and args.min_frequency < 1:
        parser.error(f"--min-frequency {args.min_frequency} must be at least 1 (a pair to merge occurs at least once)")
    if args.cased and args.model_type != "wordpiece":
        parser.error(f"--cased is for --model-type wordpiece; {args.model_type} always keeps case: drop it")
    if args.min_frequency is None:
        args.min_frequency = 2


def main(argv=None) -> int:
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="JSONL (optionally .gz) or plain text file")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="JSONL fields to train on")
    parser.add_argument("--output-prefix", required=True, type=output_prefix, help="writes PREFIX.model/.vocab (SentencePiece) "
                        "PREFIX-vocab.json/-merges.txt (byte-level-bpe) or PREFIX-vocab.txt (wordpiece)")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--model-type", choices=["bpe", "unigram", "byte-level-bpe", "wordpiece"], default="bpe",
                        help="SentencePiece bpe/unigram, GPT-2-style byte-level BPE, or BERT WordPiece")
    parser.add_argument("--min-frequency", type=int, default=None,
                        help="byte-level-bpe, wordpiece: rarest pair to merge (default 2; SentencePiece has none)")
    parser.add_argument("--cased", action="store_true",
                        help="wordpiece: keep case and accents (for BertWordPieceCase; default lower-cases)")
    parser.add_argument("--verbose", action="store_true", help="show SentencePiece's training log")
    args = parser.parse_args(argv)
    _check_model_flags(parser, args)
    if not os.path.isfile(args.input):
        print(f"{args.input}: input file not found (--input)", file=sys.stderr)
        return 2
    try:  # before the (long) reading and training: a file standing where the folder should be is the user's to fix
        os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
    except OSError as e:
        print(f"--output-prefix {args.output_prefix}: cannot write the tokenizer there ({e})", file=sys.stderr)
        return 2
    try:
        # read everything first (SentencePiece holds its input in memory anyway), so a malformed
        # line is reported as file:line here rather than wrapped in SentencePiece's own error
        texts = _read_all(args.input, args.json_keys)
        if not any(t.strip() for t in texts):
            raise ValueError(f"{args.input}: no text to train on (--json-keys {' '.join(args.json_keys)})")
        if args.model_type == "byte-level-bpe":
            paths = train_byte_level_bpe(texts, args.output_prefix, args.vocab_size, args.min_frequency)
            print(f"Wrote {paths[0]} and {paths[1]} (use --tokenizer-type GPT2BPETokenizer "
                  f"--vocab-file {paths[0]} --merge-file {paths[1]})")
            _say_if_short(paths[0], args.vocab_size)
        elif args.model_type == "wordpiece":
            path = train_wordpiece_vocab(texts, args.output_prefix, args.vocab_size, not args.cased, args.min_frequency)
            kind = "BertWordPieceCase" if args.cased else "BertWordPieceLowerCase"
            print(f"Wrote {path} (use --tokenizer-type {kind} --vocab-file {path})")
        else:
            model = train_sentencepiece(texts, args.output_prefix, args.vocab_size, args.model_type, args.verbose)
            print(f"Wrote {model} (use --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model {model})")
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
