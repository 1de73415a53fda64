"""The tokenizer of a Hugging Face export: files ``AutoTokenizer`` reads back to exactly our token
ids, and the special-token ids ``config.json`` and ``generation_config.json`` carry.

Per ``--tokenizer-type`` the training run used (saved in its config):

* ``GPT2BPETokenizer``: ``vocab.json`` + ``merges.txt`` and the same as ``tokenizer.json``
  (byte-level BPE), read as ``GPT2Tokenizer`` (no prefix space, no BOS added);
* ``GPTSentencePieceTokenizer`` / ``SentencePieceTokenizer``: ``tokenizer.model`` and a
  ``tokenizer.json`` converted from it by ``transformers`` following the model's own normalizer,
  with Megatron's appended special tokens (``<CLS> <SEP> <EOD> <MASK> ...``) at our ids; for a BERT
  (``SentencePieceTokenizer``) also its cls / sep / mask / pad / unk tokens and a post-processor
  that lays out ``<CLS> A <SEP> B <SEP>`` with token types 0 then 1, as our BERT samples are;
* ``HuggingFaceTokenizer``: its ``tokenizer.json`` as it is;
* ``BertWordPieceLowerCase`` / ``BertWordPieceCase``: ``vocab.txt``, read as ``BertTokenizer``
  (``[CLS] ... [SEP]`` added, as our BERT samples have them);
* ``TikTokenizer``, ``Llama2Tokenizer``: nothing (one line says so; the weights are still written).

Before anything is written the files are read back with ``transformers.AutoTokenizer`` and must
give our ids on a set of test texts; a tokenizer Hugging Face would read differently is not
written (one line says so), so no downstream tool reads wrong tokens. Texts holding a special
token's literal string (``</s>``) are not compared: Hugging Face reads those as the special token.
A checkpoint converted from Hugging Face keeps the files it came with.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

from ..data.chat_template import encode, hf_chat_template
from ..data.tokenizers import build_tokenizer

SAMPLE_TEXTS = (
    "Hello world", "The quick brown fox jumps over the lazy dog.", "I'm  here, 123 ok\n\nnew paragraph",
    "  leading and trailing  ", "tabs\tand\r\nCRLF\n   x", "café naïve Ångström — “quotes” … 日本語 🙂 ©",
    "numbers 0 12 123456 3.14159 -42 1e10 2,000", "Contractions: I'm you're can't Y'ALL'RE", "a",
)
BERT_TYPES = ("BertWordPieceLowerCase", "BertWordPieceCase")
NOT_EXPORTED = ("TikTokenizer", "Llama2Tokenizer")


def _ours(config: dict, files: dict):
    """Our tokenizer as the training run built it, from the files the export carries (None: none)."""
    kind = config.get("tokenizer_type")
    if kind in (None, "NullTokenizer"):
        return None
    model = files.get("tokenizer.json") if kind == "HuggingFaceTokenizer" else files.get("tokenizer.model")
    return build_tokenizer(kind, vocab_file=files.get("vocab.txt" if kind in BERT_TYPES else "vocab.json"),
                           merge_file=files.get("merges.txt"), tokenizer_model=model)


def _is_bert(config: dict) -> bool:
    """Whether the export is a BERT's tokenizer whose files we write: a WordPiece vocabulary, or a BERT
    run's Megatron SentencePieceTokenizer (pretrain_bert.py saves ``bert_no_binary_head``, which
    ``hf.pick_style`` reads too). A tokenizer.json goes as it is, with its own post-processor."""
    kind = config.get("tokenizer_type")
    return kind in BERT_TYPES or (kind == "SentencePieceTokenizer" and "bert_no_binary_head" in config)


def special_token_ids(config: dict, tok) -> dict:
    """``{bos_token_id, eos_token_id, pad_token_id}`` for config.json (end of document = eos; GPT-2's
    convention of bos = eos where the tokenizer has no bos). Without a tokenizer (NullTokenizer,
    --mock-data) the end of document is the last id."""
    if tok is None:
        if config.get("tokenizer_type") in (None, "NullTokenizer") and config.get("vocab_size"):
            eod = int(config["vocab_size"]) - 1
            return {"bos_token_id": eod, "eos_token_id": eod}
        return {}
    if _is_bert(config):
        return {"pad_token_id": int(tok.pad)} if tok.pad is not None else {}
    eod = tok.eod if tok.eod is not None else tok.eos
    out = {"bos_token_id": tok.bos if tok.bos is not None else eod, "eos_token_id": eod, "pad_token_id": tok.pad}
    return {k: int(v) for k, v in out.items() if v is not None}


def _token(tok, i):
    return None if i is None else tok.inv_vocab[i]


def _sentencepiece_json(tok, model_file: str, folder: str, bert: bool) -> None:
    """``tokenizer.json`` converted from the SentencePiece model, with our appended special tokens (and
    for a BERT the post-processor of our samples: ``<CLS> A <SEP> B <SEP>``, token types 0 then 1)."""
    from tokenizers import AddedToken, processors
    from transformers.convert_slow_tokenizer import SpmConverter, import_protobuf

    proto = import_protobuf().ModelProto()
    with open(model_file, "rb") as f:
        proto.ParseFromString(f.read())
    pieces = [(p.piece, p.score) for p in proto.pieces]
    vocab = pieces if proto.trainer_spec.model_type == 1 else {p: i for i, (p, _) in enumerate(pieces)}  # 1: unigram
    hf = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab)
    special = getattr(tok, "special", {})
    for token, _ in sorted(special.items(), key=lambda kv: kv[1]):  # appended in id order: the same ids
        hf.add_special_tokens([AddedToken(token, special=True, normalized=False)])
    if bert:
        cls, sep = _token(tok, tok.cls), _token(tok, tok.sep)
        hf.post_processor = processors.TemplateProcessing(
            single=f"{cls}:0 $A:0 {sep}:0", pair=f"{cls}:0 $A:0 {sep}:0 $B:1 {sep}:1",
            special_tokens=[(cls, tok.cls), (sep, tok.sep)])
    hf.save(os.path.join(folder, "tokenizer.json"))


def _write(kind: str, tok, files: dict, folder: str, bert: bool) -> None:
    """This tokenizer's Hugging Face files into ``folder``."""
    names = {"GPT2BPETokenizer": ("vocab.json", "merges.txt"), "HuggingFaceTokenizer": ("tokenizer.json",),
             "GPTSentencePieceTokenizer": ("tokenizer.model",), "SentencePieceTokenizer": ("tokenizer.model",)}
    for name in names.get(kind, ("vocab.txt",)):
        shutil.copyfile(files[name], os.path.join(folder, name))
    cfg = {"model_max_length": 1 << 30, "clean_up_tokenization_spaces": False}
    if kind in BERT_TYPES:
        cfg.update(tokenizer_class="BertTokenizer", do_lower_case=kind == "BertWordPieceLowerCase",
                   unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]", mask_token="[MASK]")
    else:
        eod = tok.eod if tok.eod is not None else tok.eos
        cfg.update(tokenizer_class="GPT2Tokenizer" if kind == "GPT2BPETokenizer" else "PreTrainedTokenizerFast",
                   bos_token=_token(tok, tok.bos if tok.bos is not None else eod), eos_token=_token(tok, eod),
                   pad_token=_token(tok, tok.pad), add_bos_token=False, add_eos_token=False, add_prefix_space=False)
        if bert:  # a BERT's SentencePieceTokenizer: the tokens a fill-mask pipeline and pairs need
            cfg.update(cls_token=_token(tok, tok.cls), sep_token=_token(tok, tok.sep), mask_token=_token(tok, tok.mask),
                       unk_token=_token(tok, tok.sp.unk_id()) if tok.sp.unk_id() >= 0 else None,
                       model_input_names=["input_ids", "token_type_ids", "attention_mask"])
        if kind in ("GPTSentencePieceTokenizer", "SentencePieceTokenizer"):
            _sentencepiece_json(tok, files["tokenizer.model"], folder, bert)
        template = hf_chat_template(tok)  # the one the run's chat data was rendered with (a HuggingFaceTokenizer's)
        if template is not None:
            cfg["chat_template"] = template[0]
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({k: v for k, v in cfg.items() if v is not None}, f, indent=2)


def _bert_pair_mismatch(tok, auto) -> str | None:
    """Why AutoTokenizer does not lay out a BERT pair as our samples are (None when it does):
    ``[CLS] A [SEP] B [SEP]``, token types 0 up to the first [SEP], 1 after; and its mask token."""
    a, b = SAMPLE_TEXTS[1], SAMPLE_TEXTS[0]
    ta, tb = list(tok.tokenize(a)), list(tok.tokenize(b))
    want = ([tok.cls, *ta, tok.sep, *tb, tok.sep], [0] * (len(ta) + 2) + [1] * (len(tb) + 1))
    got = auto(a, b)
    if (got["input_ids"], got.get("token_type_ids")) != want:
        return f"the pair ({a!r}, {b!r}) gives {got['input_ids'][:8]} there, {want[0][:8]} here"
    if auto.mask_token_id != tok.mask:
        return f"its mask token is {auto.mask_token!r} there, {_token(tok, tok.mask)!r} here"
    return None


def _mismatch(kind: str, tok, folder: str, bert: bool) -> str | None:
    """Why AutoTokenizer on ``folder`` does not give our ids (None when it does)."""
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(folder)
    specials = [t for t in auto.all_special_tokens if t]
    for text in SAMPLE_TEXTS:
        if any(s in text for s in specials):
            continue
        # without special tokens: the text's own ids (a tokenizer.json's post-processor may add a BOS to ours)
        plain, got = encode(tok, text), auto.encode(text, add_special_tokens=False)
        if got != plain:
            return f"{text!r} gives {got[:8]} there, {plain[:8]} here (without special tokens)"
        ours = list(tok.tokenize(text))
        want, got = ([tok.cls, *ours, tok.sep] if bert else ours), auto.encode(text)
        if got != want:
            return f"{text!r} gives {got[:8]} there, {want[:8]} here"
    return _bert_pair_mismatch(tok, auto) if bert else None


def export_tokenizer(config: dict, files: dict, save_dir: str) -> tuple[dict, str]:
    """Write the tokenizer into ``save_dir``; returns (the special-token ids for config.json, a line
    saying what was written as the tokenizer, or why nothing)."""
    from ..errors import ConfigError
    from .hf_io import copy_tokenizer_files

    kind = config.get("tokenizer_type")
    if kind in (None, "NullTokenizer"):
        if files:  # a checkpoint converted from Hugging Face: its files as they came
            copy_tokenizer_files(files, save_dir)
            return {}, f"tokenizer: the source's files ({', '.join(sorted(files))})"
        return special_token_ids(config, None), "tokenizer: none (the run read token ids as text: --mock-data)"
    if kind in NOT_EXPORTED:
        return {}, (f"tokenizer: {kind} not written (no Hugging Face tokenizer is made from it); give your tools "
                    f"the training tokenizer file ({config.get('tokenizer_model')}) yourself")
    try:
        tok = _ours(config, files)
    except (ConfigError, OSError, ValueError, KeyError, ImportError) as err:  # DataFileError is an OSError
        missing = [config[k] for k in ("vocab_file", "merge_file", "tokenizer_model")
                   if isinstance(config.get(k), str) and not os.path.exists(config[k])]
        if missing:  # an older checkpoint names them as its run was given them (now: absolute paths)
            return {}, (f"tokenizer: {kind} not written ({missing[0]}, the file the checkpoint names, is not found "
                        f"from {os.getcwd()}: a relative path is relative to the folder the training run started in; "
                        "convert from there)")
        return {}, f"tokenizer: {kind} not written (its files do not load: {err})"
    if config.get("vocab_size") and tok.vocab_size != config["vocab_size"]:
        return {}, (f"tokenizer: {kind} not written: its files give {tok.vocab_size} tokens, the model has "
                    f"{config['vocab_size']} (they are not the training tokenizer's)")
    special, bert = special_token_ids(config, tok), _is_bert(config)
    try:
        import transformers  # noqa: F401
    except ImportError:
        return special, f"tokenizer: {kind} not written (checking it needs transformers: pip install transformers)"
    staging = tempfile.mkdtemp(prefix=".tokenizer.", dir=save_dir)
    try:
        _write(kind, tok, files, staging, bert)
        why = _mismatch(kind, tok, staging, bert)
        if why is not None:
            return special, (f"tokenizer: {kind} not written: Hugging Face would read it with other ids ({why}); "
                             "give your tools the training tokenizer files yourself")
        for name in os.listdir(staging):
            os.replace(os.path.join(staging, name), os.path.join(save_dir, name))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return special, f"tokenizer: {kind} (AutoTokenizer gives the training ids)"


def _lower_case_normalizer(norm) -> bool:
    """Whether a tokenizer.json normalizer lower-cases (BertNormalizer's flag, or a Lowercase step)."""
    if not isinstance(norm, dict):
        return False
    if norm.get("type") == "BertNormalizer":
        return bool(norm.get("lowercase", True))
    return norm.get("type") == "Lowercase" or any(map(_lower_case_normalizer, norm.get("normalizers") or []))


def wordpiece_of_tokenizer_json(path: str) -> tuple[list[str], bool] | None:
    """(the tokens in id order, lower-cased) of a WordPiece ``tokenizer.json`` (what ``transformers``
    saves for a BERT, often without a vocab.txt); None for another model or ids a vocab.txt cannot
    hold (gaps, a token with a line break)."""
    try:
        with open(path, encoding="utf-8") as f:
            spec = json.load(f)
    except (OSError, ValueError):
        return None
    model = spec.get("model") if isinstance(spec, dict) else None
    if not isinstance(model, dict) or model.get("type") != "WordPiece" or not isinstance(model.get("vocab"), dict):
        return None
    vocab = dict(model["vocab"])
    vocab.update({t.get("content"): t.get("id") for t in spec.get("added_tokens") or [] if isinstance(t, dict)})
    by_id = sorted(vocab.items(), key=lambda kv: kv[1] if isinstance(kv[1], int) else -1)
    tokens = [t for t, _ in by_id]
    if [i for _, i in by_id] != list(range(len(by_id))) or any(not t or "\n" in t or t != t.strip() for t in tokens):
        return None
    return tokens, _lower_case_normalizer(spec.get("normalizer"))


def add_bert_vocab_txt(folder: str) -> bool:
    """Write ``vocab.txt`` into ``folder`` from its WordPiece ``tokenizer.json`` when it has none, so
    the BERT tools (``BertWordPiece*`` tokenizers) can read it; True if written."""
    if os.path.isfile(os.path.join(folder, "vocab.txt")) or not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        return False
    found = wordpiece_of_tokenizer_json(os.path.join(folder, "tokenizer.json"))
    if found is None:
        return False
    from ..data.wordpiece import save_vocab

    save_vocab(found[0], os.path.join(folder, "vocab.txt"))
    return True


def tokenizer_in_folder(folder: str, bert: bool = False) -> dict | None:
    """The tokenizer flags (``tokenizer_type``, ``vocab_file``, ``merge_file``, ``tokenizer_model``) of
    the Hugging Face tokenizer files in ``folder`` (what convert.py keeps in ``<save>/tokenizer``);
    None when there are none. tokenizer.json first (what Hugging Face itself reads), then vocab.txt
    (BERT; lower-cased unless its tokenizer_config.json or tokenizer.json says otherwise),
    vocab.json + merges.txt, tokenizer.model. With ``bert`` (a BERT model: its tools need a WordPiece
    vocabulary with [CLS]/[SEP]/[MASK]) vocab.txt comes before a WordPiece tokenizer.json."""
    def path(name):
        full = os.path.join(folder, name)
        return full if os.path.isfile(full) else None

    wordpiece = wordpiece_of_tokenizer_json(path("tokenizer.json")) if path("tokenizer.json") else None
    if path("tokenizer.json") and not (bert and wordpiece is not None and path("vocab.txt")):
        return {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": path("tokenizer.json")}
    if path("vocab.txt"):
        lower = wordpiece[1] if wordpiece is not None else True
        if path("tokenizer_config.json"):
            with open(path("tokenizer_config.json")) as f:
                lower = bool(json.load(f).get("do_lower_case", lower))
        return {"tokenizer_type": BERT_TYPES[0] if lower else BERT_TYPES[1], "vocab_file": path("vocab.txt")}
    if path("vocab.json") and path("merges.txt"):
        return {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": path("vocab.json"), "merge_file": path("merges.txt")}
    if path("tokenizer.model"):
        return {"tokenizer_type": "GPTSentencePieceTokenizer", "tokenizer_model": path("tokenizer.model")}
    return None


def checkpoint_tokenizer(load: str, bert: bool = False) -> dict | None:
    """:func:`tokenizer_in_folder` of a checkpoint's ``tokenizer`` folder (``load``: a save folder or
    one of its ``iter_*`` folders)."""
    from .hf_io import TOKENIZER_DIR

    for root in (load, os.path.dirname(os.path.abspath(load))):
        found = tokenizer_in_folder(os.path.join(root, TOKENIZER_DIR), bert)
        if found:
            return found
    return None


def tokenizer_flags(found: dict | None) -> list[str]:
    """``--tokenizer-type ... --vocab-file ...`` of :func:`tokenizer_in_folder`'s result."""
    return [x for key, value in (found or {}).items() for x in ("--" + key.replace("_", "-"), value)]
