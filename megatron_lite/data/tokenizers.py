"""Every tokenizer Megatron's ``--tokenizer-type`` names, behind one small interface.

``build_tokenizer(type, ...)`` returns an object with:
  ``vocab_size``; special ids ``eod pad cls sep mask bos eos`` (None where the type has none);
  ``tokenize(text) -> list[int]``; ``detokenize(ids) -> str``; ``vocab`` / ``inv_vocab``
  (token -> id / id -> token) where the type has a vocabulary.

Types and their files (Megatron's flag names):
  GPT2BPETokenizer            --vocab-file vocab.json --merge-file merges.txt (GPT-2 byte-level BPE)
  SentencePieceTokenizer      --tokenizer-model x.model; adds <CLS> <SEP> <EOD> <MASK> (and pad/
                              bos/eos pieces the model lacks) after the model's pieces, as Megatron does
  GPTSentencePieceTokenizer   --tokenizer-model x.model; the model's pieces only, eod = </s> (eos)
  Llama2Tokenizer             --tokenizer-model x.model; as GPTSentencePieceTokenizer, but every text
                              tokenized starts with the model's BOS (Megatron's Llama-2 wrapper)
  TikTokenizer                --tokenizer-model vocab.json --tiktoken-pattern v1|v2; needs the optional
                              ``tiktoken`` package (data/tiktoken_tokenizer.py)
  HuggingFaceTokenizer        --tokenizer-model tokenizer.json (or a directory holding one); needs the
                              optional ``tokenizers`` package
  BertWordPieceLowerCase/Case --vocab-file vocab.txt
  NullTokenizer               --vocab-size N; text is space-separated integers 0..N-1, eod = N (vocab N + 1)
"""

from __future__ import annotations

import json
import os

from megatron_lite.data.indexed_dataset import DataFileError
from megatron_lite.errors import ConfigError
from megatron_lite.megatron_flags import RefusedFlag

TOKENIZER_TYPES = (
    "GPT2BPETokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
    "TikTokenizer",
    "HuggingFaceTokenizer",
    "BertWordPieceLowerCase",
    "BertWordPieceCase",
    "NullTokenizer",
)


class Tokenizer:
    """Base: special ids default to None; subclasses set what their vocabulary defines."""

    vocab_size: int
    eod = pad = cls = sep = mask = bos = eos = None
    vocab: dict | None = None
    inv_vocab: dict | None = None

    def tokenize(self, text: str) -> list[int]:
        raise NotImplementedError

    def detokenize(self, ids) -> str:
        raise NotImplementedError


def encodable(text: str) -> str:
    """``text``, with surrogate code points (a JSON ``"\\ud800"`` escape) made UTF-8-encodable as the
    GPT-2 encoders do (:func:`~megatron_lite.data.gpt2_bpe.utf8_encodable`): SentencePiece and
    Hugging Face tokenizers cannot take them (a pybind11 RuntimeError / a TypeError)."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        from megatron_lite.data.gpt2_bpe import utf8_encodable

        return utf8_encodable(text)
    return text


def _need(value, flag: str, tokenizer_type: str):
    if value is None:  # a user error (exit 2 in the scripts), not a crash
        raise ConfigError(f"--tokenizer-type {tokenizer_type} needs {flag}")
    if flag != "--vocab-size" and not os.path.exists(value):
        raise DataFileError(f"{value}: file not found (given as {flag} for {tokenizer_type})")
    return value


class GPT2BPETokenizer(Tokenizer):
    def __init__(self, vocab_file: str, merge_file: str):
        from megatron_lite.data.gpt2_bpe import END_OF_TEXT, GPT2BPE
        from megatron_lite.data.gpt2_fast import tiktoken_encoder

        self.bpe = GPT2BPE.from_files(vocab_file, merge_file)
        if END_OF_TEXT not in self.bpe.encoder:
            raise DataFileError(f"{vocab_file}: no {END_OF_TEXT} token (GPT-2's end-of-document token)")
        self.vocab, self.inv_vocab = self.bpe.encoder, self.bpe.decoder
        self.vocab_size = max(len(self.vocab), max(self.vocab.values()) + 1)  # ids may leave gaps
        self.eod = self.vocab[END_OF_TEXT]
        # tiktoken for GPT-2's own vocabulary when installed (same ids, compiled); else the reference
        self.backend = "tiktoken" if (fast := tiktoken_encoder(self.bpe)) else "python"
        self._encode = fast or self.bpe.encode

    def tokenize(self, text: str) -> list[int]:
        try:
            return self._encode(text)
        except UnicodeEncodeError:  # surrogate code points: UTF-8 cannot encode them as they are
            from megatron_lite.data.gpt2_bpe import utf8_encodable

            return self._encode(utf8_encodable(text))

    def detokenize(self, ids) -> str:
        return self.bpe.decode(ids)


def _load_sentencepiece(model_file: str):
    import sentencepiece

    try:
        return sentencepiece.SentencePieceProcessor(model_file=model_file)
    except (OSError, RuntimeError) as e:
        raise DataFileError(f"{model_file}: not a readable SentencePiece model ({e})") from None


def _optional_id(i: int):
    return None if i is None or i < 0 else i


class GPTSentencePieceTokenizer(Tokenizer):
    """The model's own pieces; eod is its end-of-sentence id, pad/bos its pad/bos ids (if any)."""

    def __init__(self, model_file: str):
        self.sp = _load_sentencepiece(model_file)
        self.vocab_size = self.sp.get_piece_size()
        self.inv_vocab = {i: self.sp.id_to_piece(i) for i in range(self.vocab_size)}
        self.vocab = {p: i for i, p in self.inv_vocab.items()}
        self.bos = _optional_id(self.sp.bos_id())
        self.eos = self.eod = _optional_id(self.sp.eos_id())
        self.pad = _optional_id(self.sp.pad_id())

    def tokenize(self, text: str) -> list[int]:
        return self.sp.encode_as_ids(encodable(text))

    def detokenize(self, ids) -> str:
        return self.sp.decode_ids([int(i) for i in ids])


class Llama2Tokenizer(GPTSentencePieceTokenizer):
    """Megatron's Llama-2 wrapper: the model's pieces, eod = eos = its EOS; ``tokenize`` puts the
    model's BOS first (as Llama-2 was trained: one per document, one per sentence with
    ``--split-sentences``), ``detokenize`` drops BOS/EOS (SentencePiece's control pieces)."""

    def __init__(self, model_file: str):
        super().__init__(model_file)
        if self.bos is None:
            raise DataFileError(f"{model_file}: the SentencePiece model has no BOS piece (bos_id -1), which "
                                "Llama2Tokenizer puts before every text; use --tokenizer-type GPTSentencePieceTokenizer")

    def tokenize(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        ids = super().tokenize(text)
        return [self.bos] * bos + ids + [self.eos] * (eos and self.eos is not None)


class SentencePieceTokenizer(GPTSentencePieceTokenizer):
    """Megatron's SentencePieceTokenizer: special tokens appended after the model's pieces.

    <CLS>, <SEP>, <EOD>, <MASK>, then the model's pad/bos/eos pieces (or <PAD>/<BOS>/<EOS> when the
    model has none), then ``<extra_id_0..n-1>`` (``vocab_extra_ids``, T5's sentinels: for code that
    builds this class; the ``--vocab-extra-ids`` flag is refused, as there is no T5 here); each gets
    a new id only if it is not already a piece.  Special tokens written literally in the text are
    encoded as their ids.
    """

    def __init__(self, model_file: str, vocab_extra_ids: int = 0):
        super().__init__(model_file)
        self.special = {}

        def add(token: str) -> int:
            if token not in self.vocab:
                self.vocab[token] = len(self.vocab)
                self.inv_vocab[self.vocab[token]] = token
            self.special[token] = self.vocab[token]
            return self.vocab[token]

        def model_piece(i: int, fallback: str) -> str:
            return self.sp.id_to_piece(i) if i >= 0 else fallback

        self.cls, self.sep, self.eod, self.mask = (add(t) for t in ("<CLS>", "<SEP>", "<EOD>", "<MASK>"))
        self.pad = add(model_piece(self.sp.pad_id(), "<PAD>"))
        self.bos = add(model_piece(self.sp.bos_id(), "<BOS>"))
        self.eos = add(model_piece(self.sp.eos_id(), "<EOS>"))
        for i in range(vocab_extra_ids):
            add(f"<extra_id_{i}>")
        self.vocab_size = len(self.vocab)
        self.inv_special = {i: t for t, i in self.special.items()}

    def tokenize(self, text: str) -> list[int]:
        text = encodable(text)
        ids, pos = [], 0
        while True:
            hits = [(text.find(t, pos), t) for t in self.special]
            hits = [(at, -len(t), t) for at, t in hits if at >= 0]
            if not hits:
                break
            at, _, token = min(hits)
            ids.extend(self.sp.encode_as_ids(text[pos:at]))
            ids.append(self.special[token])
            pos = at + len(token)
        ids.extend(self.sp.encode_as_ids(text[pos:]))
        return ids

    def detokenize(self, ids) -> str:
        parts, run = [], []
        for i in (int(i) for i in ids):
            if i in self.inv_special:
                parts.append(self.sp.decode_ids(run))
                parts.append(self.inv_special[i])
                run = []
            else:
                run.append(i)
        parts.append(self.sp.decode_ids(run))
        return "".join(parts)


class HuggingFaceTokenizer(Tokenizer):
    """A local ``tokenizer.json`` through the ``tokenizers`` package (no hub, no transformers)."""

    EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")
    PAD_CANDIDATES = ("<pad>", "[PAD]", "<|pad|>", "<|padding|>")

    def __init__(self, path: str):
        try:
            import tokenizers
        except ImportError:
            raise ImportError("HuggingFaceTokenizer needs the optional 'tokenizers' package: "
                              "pip install tokenizers  (or pip install megatron_lite[hf])") from None
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        self.path = path  # its folder may hold tokenizer_config.json / chat_template.jinja (data/chat_template.py)
        try:
            self.hf = tokenizers.Tokenizer.from_file(path)
        except Exception as e:
            raise DataFileError(f"{path}: not a readable Hugging Face tokenizer.json ({e})") from None
        self.vocab = self.hf.get_vocab(with_added_tokens=True)
        self.inv_vocab = {i: t for t, i in self.vocab.items()}
        # ids up to the largest one (a tokenizer.json may leave gaps): what the embedding and the token dtype need
        self.vocab_size = max(self.hf.get_vocab_size(with_added_tokens=True), max(self.vocab.values(), default=-1) + 1)
        # as transformers' AutoTokenizer (Megatron's eod = eos_token_id): tokenizer_config.json's tokens first
        folder = os.path.dirname(os.path.abspath(path))  # older repos name them in special_tokens_map.json only
        config = {**self._config_tokens(os.path.join(folder, "special_tokens_map.json")),
                  **self._config_tokens(os.path.join(folder, "tokenizer_config.json"))}
        self.eod = self.eos = next((self.vocab[t] for t in (config.get("eos_token"), *self.EOD_CANDIDATES)
                                    if t in self.vocab), None)
        self.pad = next((self.vocab[t] for t in (config.get("pad_token"), *self.PAD_CANDIDATES) if t in self.vocab),
                        None)
        self.bos = self.vocab.get(config["bos_token"]) if "bos_token" in config else None  # as AutoTokenizer's

    @staticmethod
    def _config_tokens(path: str) -> dict:
        """The special-token strings (eos_token, pad_token, ...) of a tokenizer_config.json or
        special_tokens_map.json, if there is one."""
        if not os.path.isfile(path):
            return {}
        try:
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError) as e:
            raise DataFileError(f"{path}: not a readable {os.path.basename(path)} ({e})") from None
        tokens = {}
        for key, value in (config.items() if isinstance(config, dict) else ()):
            value = value.get("content") if isinstance(value, dict) else value
            if key.endswith("_token") and isinstance(value, str):
                tokens[key] = value
        return tokens

    def tokenize(self, text: str) -> list[int]:
        try:
            return self.hf.encode(encodable(text)).ids
        except Exception as e:  # the Rust side raises a bare Exception (e.g. an unk_token missing from its vocab)
            raise ValueError(f"{self.path} cannot encode this text ({e})") from None

    def detokenize(self, ids) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=False)


class BertWordPieceTokenizer(Tokenizer):
    def __init__(self, vocab_file: str, lower_case: bool):
        from megatron_lite.data.wordpiece import WordPieceTokenizer

        self.wp = WordPieceTokenizer(vocab_file, lower_case)
        self.vocab, self.inv_vocab = self.wp.vocab, self.wp.inv_vocab
        self.vocab_size = max(self.inv_vocab) + 1  # every line of vocab.txt (a repeated token leaves a gap)
        self.cls, self.sep = self.vocab["[CLS]"], self.vocab["[SEP]"]
        self.mask, self.pad = self.vocab["[MASK]"], self.vocab["[PAD]"]

    def tokenize(self, text: str) -> list[int]:
        return self.wp.encode(text)

    def detokenize(self, ids) -> str:
        return self.wp.decode(ids)


class NullTokenizer(Tokenizer):
    """Text is already token ids, separated by spaces (Megatron's ``NullTokenizer``).

    ``--vocab-size N`` means ids ``0..N-1`` are text and ``N`` is the end of document, so the
    tokenizer's ``vocab_size`` is ``N + 1`` and ``eod = vocab_size - 1`` (as in Megatron-LM).
    """

    def __init__(self, vocab_size: int):
        self.vocab_size = int(vocab_size) + 1
        self.eod = int(vocab_size)

    def tokenize(self, text: str) -> list[int]:
        try:
            ids = [int(t) for t in text.split()]
        except ValueError:
            raise ValueError("NullTokenizer expects space-separated integers") from None
        if any(not 0 <= i < self.eod for i in ids):
            raise ValueError(f"NullTokenizer: a token id is outside [0, {self.eod}) (--vocab-size {self.eod})")
        return ids

    def detokenize(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)


def build_tokenizer(tokenizer_type: str, vocab_file=None, merge_file=None, tokenizer_model=None,
                    vocab_size=None, tiktoken_pattern=None, tiktoken_num_special_tokens=None,
                    tiktoken_special_tokens=None) -> Tokenizer:
    """Build the tokenizer Megatron's ``--tokenizer-type`` names, from local files only."""
    t = tokenizer_type
    given = [f"--{k.replace('_', '-')}" for k, v in (("tiktoken_pattern", tiktoken_pattern),
             ("tiktoken_special_tokens", tiktoken_special_tokens)) if v is not None]
    given += ["--tiktoken-num-special-tokens"] * (tiktoken_num_special_tokens not in (None, 1000))
    if t != "TikTokenizer" and given:  # refused, not ignored
        raise ConfigError(f"{given[0]} applies to --tokenizer-type TikTokenizer only (not {t}); drop it")
    if t == "TikTokenizer":
        from megatron_lite.data.tiktoken_tokenizer import TikTokenizer

        return TikTokenizer(_need(tokenizer_model, "--tokenizer-model", t), tiktoken_pattern, vocab_size,
                            tiktoken_num_special_tokens, tiktoken_special_tokens)
    if t == "Llama2Tokenizer":
        return Llama2Tokenizer(_need(tokenizer_model, "--tokenizer-model", t))
    if t == "GPT2BPETokenizer":
        return GPT2BPETokenizer(_need(vocab_file, "--vocab-file", t), _need(merge_file, "--merge-file", t))
    if t == "SentencePieceTokenizer":
        return SentencePieceTokenizer(_need(tokenizer_model, "--tokenizer-model", t))
    if t == "GPTSentencePieceTokenizer":
        return GPTSentencePieceTokenizer(_need(tokenizer_model, "--tokenizer-model", t))
    if t == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(_need(tokenizer_model, "--tokenizer-model", t))
    if t in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        return BertWordPieceTokenizer(_need(vocab_file, "--vocab-file", t), t == "BertWordPieceLowerCase")
    if t == "NullTokenizer":
        if int(_need(vocab_size, "--vocab-size", t)) < 1:  # else every id is "outside [0, 0)" at the first text
            raise ConfigError(f"--vocab-size {vocab_size} must be at least 1 (NullTokenizer: ids 0..N-1 are text)")
        return NullTokenizer(vocab_size)
    raise ConfigError(f"--tokenizer-type {t!r} is not one of {', '.join(TOKENIZER_TYPES)}")


def add_tokenizer_args(parser) -> None:
    """Megatron's tokenizer flags, for tools that build a tokenizer."""
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    group.add_argument("--vocab-file", default=None, help="vocab.json (GPT-2 BPE) or vocab.txt (WordPiece)")
    group.add_argument("--merge-file", default=None, help="merges.txt (GPT-2 BPE)")
    group.add_argument("--tokenizer-model", default=None,
                       help="SentencePiece .model, tokenizer.json for HuggingFaceTokenizer, the vocabulary .json "
                            "for TikTokenizer")
    group.add_argument("--vocab-size", type=int, default=None,
                       help="NullTokenizer vocabulary size; TikTokenizer's (default 131072)")
    group.add_argument("--tiktoken-pattern", default=None, choices=["v1", "v2"],
                       help="TikTokenizer: the regex that splits text before BPE")
    group.add_argument("--tiktoken-num-special-tokens", type=int, default=1000,
                       help="TikTokenizer: ids reserved for special tokens at the start of the vocabulary")
    group.add_argument("--tiktoken-special-tokens", nargs="+", default=None,
                       help="TikTokenizer: the special tokens, from id 0 (must include <unk> <s> </s>; the default)")
    # Megatron-LM's preprocess_data.py takes it (T5's sentinel tokens); training here refuses it, so a
    # dataset tokenized with sentinels no run could read is refused with training's line
    group.add_argument("--vocab-extra-ids", action=RefusedFlag)


def tokenizer_kwargs(args) -> dict:
    """The build_tokenizer keyword arguments held in parsed CLI args (picklable, for workers)."""
    return dict(tokenizer_type=args.tokenizer_type, vocab_file=args.vocab_file,
                merge_file=args.merge_file, tokenizer_model=args.tokenizer_model,
                vocab_size=args.vocab_size, **tiktoken_kwargs(args))


TIKTOKEN_FIELDS = ("tiktoken_pattern", "tiktoken_num_special_tokens", "tiktoken_special_tokens")


def tiktoken_kwargs(args) -> dict:
    """TikTokenizer's build_tokenizer keyword arguments held in ``args`` (parsed flags, a Config's data
    section or a checkpoint's saved config as a namespace); None where ``args`` lacks one."""
    return {k: getattr(args, k, None) for k in TIKTOKEN_FIELDS}
