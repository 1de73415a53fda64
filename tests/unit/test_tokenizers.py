"""Tokenizers: hand-checked cases, exact round trips, and GPT-2 BPE against Hugging Face's
independent ByteLevel BPE implementation (the same algorithm) on the same vocab/merges."""

import json
import os

import pytest

from megatron_lite.data.gpt2_bpe import (
    BYTE_ENCODER,
    GPT2_PATTERN,
    apply_merges,
    save_vocab_and_merges,
    train_gpt2_bpe,
)
from megatron_lite.data.indexed_dataset import DataFileError
from megatron_lite.data.tokenizers import SentencePieceTokenizer, build_tokenizer
from megatron_lite.data.wordpiece import basic_tokenize
from tests.tools import load_tool

FIXTURES = os.path.join(os.path.dirname(__file__), os.pardir, "fixtures")
TRICKY = [
    "Hello world",
    "I'm  here, 123 ok\n\n",
    "  leading and trailing  ",
    "tabs\t\tand\r\nCRLF\n\n\n   x",
    "café naïve Ångström — “quotes” … 日本語 🙂🚀 ©® ∑∫",
    "Contractions: I'm you're he's she'll we've they'd can't Y'ALL'RE 'S",
    "numbers 0 12 123456 3.14159 -42 1e10 2,000",
    "<|endoftext|> is ordinary text here",
    "\x00\x01 control \x7f bytes",
    "",
    " ",
]


def corpus_texts():
    with open(os.path.join(FIXTURES, "tiny_corpus.jsonl"), encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt2")
    encoder, merges = train_gpt2_bpe(corpus_texts() * 3 + TRICKY, vocab_size=700, min_frequency=2)
    save_vocab_and_merges(encoder, merges, str(d / "vocab.json"), str(d / "merges.txt"))
    return str(d / "vocab.json"), str(d / "merges.txt")


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    train = load_tool("train_tokenizer")
    prefix = str(tmp_path_factory.mktemp("spm") / "tiny")
    return train.train_sentencepiece(corpus_texts() * 2, prefix, vocab_size=600, model_type="bpe")


# -- GPT-2 byte-level BPE ------------------------------------------------------------------------
def test_bytes_to_unicode_is_gpt2s_map():
    assert len(BYTE_ENCODER) == 256 and len(set(BYTE_ENCODER.values())) == 256
    assert BYTE_ENCODER[ord(" ")] == "\u0120"  # "Ġ"
    assert BYTE_ENCODER[ord("\n")] == "\u010a"  # "Ċ"
    assert BYTE_ENCODER[0] == "\u0100"
    assert BYTE_ENCODER[ord("A")] == "A" and BYTE_ENCODER[0xE9] == "\u00e9"
    assert list(BYTE_ENCODER)[:3] == [ord("!"), ord('"'), ord("#")]  # vocab ids 0, 1, 2


def test_gpt2_pretokenization_by_hand():
    assert GPT2_PATTERN.findall("I'm  here, 123 ok\n\n") == ["I", "'m", " ", " here", ",", " 123", " ok", "\n\n"]
    assert GPT2_PATTERN.findall("they'll DON'T") == ["they", "'ll", " DON", "'", "T"]  # case-sensitive
    assert GPT2_PATTERN.findall("a  \tb") == ["a", "  ", "\t", "b"]
    assert GPT2_PATTERN.findall("x   y") == ["x", "  ", " y"]


def test_merge_order_by_hand(tmp_path):
    b = BYTE_ENCODER
    merges = [(b[ord(" ")], "t"), ("h", "e"), (b[ord(" ")] + "t", "he"), ("e", "r"), ("a", "a")]
    encoder = {c: i for i, c in enumerate(BYTE_ENCODER.values())}
    for x, y in merges:
        encoder[x + y] = len(encoder)
    encoder["<|endoftext|>"] = len(encoder)
    save_vocab_and_merges(encoder, merges, str(tmp_path / "v.json"), str(tmp_path / "m.txt"))
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "v.json"), merge_file=str(tmp_path / "m.txt"))
    assert tok.vocab_size == 256 + 5 + 1 and tok.eod == 261
    # " the" -> Ġt + he -> Ġthe (rank 2); "there": he (rank 1) wins over er (rank 3), leaving t|he|r|e.
    assert tok.tokenize(" the") == [encoder["Ġthe"]]
    assert tok.tokenize("there") == [encoder["t"], encoder["he"], encoder["r"], encoder["e"]]
    # Every occurrence of the best pair merges, left to right: "aaa" -> aa|a.
    assert apply_merges(list("aaa"), {("a", "a"): 0}) == ["aa", "a"]
    assert tok.tokenize("aaaaa") == [encoder["aa"], encoder["aa"], encoder["a"]]
    assert tok.detokenize(tok.tokenize("aaaaa there")) == "aaaaa there"


def test_gpt2_round_trip(gpt2_files):
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=gpt2_files[0], merge_file=gpt2_files[1])
    assert tok.vocab_size <= 700 and tok.eod == tok.vocab_size - 1
    for text in corpus_texts() + TRICKY:
        ids = tok.tokenize(text)
        assert tok.detokenize(ids) == text
        assert tok.tokenize(text) == ids  # second call goes through the word cache
    assert len(tok.tokenize("the quick brown fox")) < len("the quick brown fox")  # merges were learned


def test_trainer_picks_most_frequent_pair_first():
    encoder, merges = train_gpt2_bpe(["abab abab xy"], vocab_size=256 + 3, min_frequency=1)
    # Words: "abab" (1), " abab" (1), " xy" (1); pair (a, b) occurs 4 times, more than any other.
    assert merges[0] == ("a", "b")
    assert encoder["ab"] == 256 and len(encoder) == 259
    assert train_gpt2_bpe(["abab abab xy"], 259, 1) == (encoder, merges)  # deterministic


def test_gpt2_vocab_with_an_id_gap_sizes_the_vocabulary_by_its_largest_id(gpt2_files, tmp_path):
    """A vocab.json whose ids skip some (here <|endoftext|> moved to 70000): vocab_size is 70001, so
    the token dtype and the embedding have room for it (it was the token count)."""
    vocab = json.load(open(gpt2_files[0], encoding="utf-8"))
    vocab["<|endoftext|>"] = 70000
    (tmp_path / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "vocab.json"), merge_file=gpt2_files[1])
    assert tok.eod == 70000 and tok.vocab_size == 70001


def test_gpt2_matches_huggingface_byte_level_bpe(gpt2_files):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers

    hf = tokenizers.Tokenizer(models.BPE.from_file(*gpt2_files))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    ours = build_tokenizer("GPT2BPETokenizer", vocab_file=gpt2_files[0], merge_file=gpt2_files[1])
    texts = corpus_texts() + TRICKY + ["".join(TRICKY), "The quick brown fox jumps over the lazy dog " * 5]
    for text in texts:
        assert ours.tokenize(text) == hf.encode(text).ids, text


# -- SentencePiece ---------------------------------------------------------------------------------
def test_sentencepiece_round_trip_and_specials(sp_model):
    gpt = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=sp_model)
    meg = SentencePieceTokenizer(sp_model, vocab_extra_ids=2)  # the class only: --vocab-extra-ids is refused
    assert gpt.vocab_size == 600 and gpt.eod == 2 and gpt.bos == 1 and gpt.pad is None
    # Megatron's variant appends <CLS> <SEP> <EOD> <MASK> <PAD> after the model's pieces (the model
    # has bos/eos pieces already), then the extra ids.
    assert (meg.cls, meg.sep, meg.eod, meg.mask, meg.pad) == (600, 601, 602, 603, 604)
    assert (meg.bos, meg.eos) == (1, 2) and meg.vocab_size == 607
    assert meg.vocab["<extra_id_1>"] == 606
    for text in corpus_texts() + TRICKY:
        assert gpt.detokenize(gpt.tokenize(text)) == text
        assert meg.detokenize(meg.tokenize(text)) == text
    ids = meg.tokenize("a<EOD>b<MASK>")
    assert ids.count(meg.eod) == 1 and ids[-1] == meg.mask
    assert meg.detokenize(ids) == "a<EOD>b<MASK>"


# -- WordPiece -------------------------------------------------------------------------------------
@pytest.fixture
def bert_vocab(tmp_path):
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "un", "##aff", "##able", "hello", "world",
              ",", "!", "Hello", "##s", "cafe", "日", "本"]
    path = tmp_path / "vocab.txt"
    path.write_text("\n".join(tokens) + "\n", encoding="utf-8")
    return str(path), {t: i for i, t in enumerate(tokens)}


def test_wordpiece_by_hand(bert_vocab):
    path, v = bert_vocab
    lower = build_tokenizer("BertWordPieceLowerCase", vocab_file=path)
    assert (lower.pad, lower.cls, lower.sep, lower.mask, lower.eod) == (0, 2, 3, 4, None)
    assert lower.vocab_size == 17
    assert lower.tokenize("Hello, unaffable  WORLD!") == [v["hello"], v[","], v["un"], v["##aff"], v["##able"],
                                                          v["world"], v["!"]]
    assert lower.tokenize("Café worlds xyz") == [v["cafe"], v["world"], v["##s"], v["[UNK]"]]
    assert lower.tokenize("日本") == [v["日"], v["本"]]
    assert lower.detokenize(lower.tokenize("Hello, unaffable worlds!")) == "hello , unaffable worlds !"
    case = build_tokenizer("BertWordPieceCase", vocab_file=path)
    assert case.tokenize("Hello hello") == [v["Hello"], v["hello"]]
    assert case.tokenize("Café") == [v["[UNK]"]]
    assert basic_tokenize("a\x00b\u00a0c\td", lower_case=False) == ["ab", "c", "d"]


# -- Null and Hugging Face -------------------------------------------------------------------------
def test_null_tokenizer():
    tok = build_tokenizer("NullTokenizer", vocab_size=100)
    assert tok.eod == 100 and tok.vocab_size == 101  # Megatron: ids 0..N-1 are text, N is EOD
    assert tok.tokenize(" 5 17\n 99 ") == [5, 17, 99]
    assert tok.detokenize([5, 17, 99]) == "5 17 99"
    with pytest.raises(ValueError, match="space-separated integers"):
        tok.tokenize("5 x")
    with pytest.raises(ValueError, match="outside"):
        tok.tokenize("100")


def test_huggingface_tokenizer(gpt2_files, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers

    hf = tokenizers.Tokenizer(models.BPE.from_file(*gpt2_files))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    gpt2 = build_tokenizer("GPT2BPETokenizer", vocab_file=gpt2_files[0], merge_file=gpt2_files[1])
    assert tok.eod == gpt2.eod and tok.vocab_size == gpt2.vocab_size
    for text in corpus_texts() + TRICKY:
        assert tok.tokenize(text) == gpt2.tokenize(text)
        assert tok.detokenize(tok.tokenize(text)) == text


# -- errors ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("eos, pad", [("<｜end▁of▁sentence｜>", "<｜pad▁token｜>"), ("</s>", None),
                                      ({"__type": "AddedToken", "content": "</s>", "special": True}, "[PAD]")])
def test_huggingface_eod_is_the_eos_token_of_tokenizer_config_json(tmp_path, eos, pad):
    """As transformers' AutoTokenizer (Megatron's eod is its eos_token_id): the eos_token / pad_token of
    the tokenizer_config.json beside tokenizer.json. Only a list of usual names was tried: a
    DeepSeek-V3 tokenizer ("<｜end▁of▁sentence｜>") had no EOD (--append-eod refused), and one with both
    "<|endoftext|>" and "</s>" got the first whatever its config said."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    specials = ["<|endoftext|>", "</s>", "<｜end▁of▁sentence｜>", "<pad>", "<｜pad▁token｜>", "[PAD]"]
    hf = tokenizers.Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.add_special_tokens(specials)
    hf.save(str(tmp_path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, **({"pad_token": pad} if pad else {})}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "tokenizer.json"))
    eos_text = eos["content"] if isinstance(eos, dict) else eos
    assert tok.eod == tok.eos == 2 + specials.index(eos_text)
    assert tok.pad == 2 + specials.index(pad or "<pad>")
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert tok.eod == reference.eos_token_id and (pad is None or tok.pad == reference.pad_token_id)
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(DataFileError, match="tokenizer_config.json: not a readable"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    (tmp_path / "tokenizer_config.json").unlink()  # no config: the usual names, in order
    assert build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path)).eod == 2


def test_huggingface_special_tokens_of_special_tokens_map_json(tmp_path):
    """Older repos name their bos/eos/pad only in special_tokens_map.json (tokenizer_config.json without
    them, or none): AutoTokenizer reads it, and so do we (the bos was None, the eod a guessed name)."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    specials = ["<|endoftext|>", "<s>", "</s>", "<pad>", "<unk>"]
    hf = tokenizers.Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.add_special_tokens(specials)
    hf.save(str(tmp_path / "tokenizer.json"))
    tokens = {"bos_token": "<s>", "eos_token": {"content": "</s>", "lstrip": False}, "pad_token": "<unk>"}
    (tmp_path / "special_tokens_map.json").write_text(json.dumps(tokens), encoding="utf-8")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    assert (tok.bos, tok.eod, tok.pad) == (3, 4, 0)
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert (tok.bos, tok.eod, tok.pad) == (reference.bos_token_id, reference.eos_token_id, reference.pad_token_id)
    (tmp_path / "special_tokens_map.json").write_text("[broken")
    with pytest.raises(DataFileError, match="special_tokens_map.json: not a readable special_tokens_map.json"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))


def test_wordpiece_vocab_with_a_repeated_token_matches_the_reference_loaders(tmp_path):
    """A vocab.txt listing a token twice: its id is its last line (Megatron's and Hugging Face's
    loaders), and vocab_size counts every line so the largest id fits (it took the first line and
    the count of distinct tokens, one short of the id of the last line)."""
    (tmp_path / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nhello\nworld\nhello\n##s\n")
    tok = build_tokenizer("BertWordPieceLowerCase", vocab_file=str(tmp_path / "vocab.txt"))
    assert tok.tokenize("Hello worlds") == [7, 6, 8] and tok.vocab_size == 9
    transformers = pytest.importorskip("transformers")
    reference = transformers.BertTokenizer(str(tmp_path / "vocab.txt"), do_lower_case=True)
    assert tok.tokenize("Hello worlds") == reference.encode("Hello worlds", add_special_tokens=False)


def test_wordpiece_decodes_the_id_a_repeated_token_leaves_without_a_token(tmp_path):
    """Id 5 (the first 'hello' line) has no token but is a row of the model (vocab_size counts every
    line): a prediction of it (tools/fill_mask.py's top-k) was a KeyError traceback; it reads as
    [UNK] (transformers' BertTokenizer has no token for it either: None)."""
    (tmp_path / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nhello\nworld\nhello\n##s\n")
    tok = build_tokenizer("BertWordPieceLowerCase", vocab_file=str(tmp_path / "vocab.txt"))
    assert tok.detokenize([7, 5, 6, 8]) == "hello [UNK] worlds"
    transformers = pytest.importorskip("transformers")
    reference = transformers.BertTokenizer(str(tmp_path / "vocab.txt"), do_lower_case=True)
    assert reference.convert_ids_to_tokens([5]) in (["[UNK]"], [None])  # no token (v4 said [UNK], v5 None)


def test_bad_files_are_clear_errors(tmp_path, gpt2_files):
    with pytest.raises(DataFileError, match="nope.json: file not found"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "nope.json"), merge_file=gpt2_files[1])
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(DataFileError, match="bad.json: cannot read GPT-2 vocab.json"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "bad.json"), merge_file=gpt2_files[1])
    (tmp_path / "m.txt").write_text("#version: 0.2\nzz qq\n")
    with pytest.raises(DataFileError, match="do not belong together"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=gpt2_files[0], merge_file=str(tmp_path / "m.txt"))
    (tmp_path / "bad.model").write_bytes(b"garbage")
    with pytest.raises(DataFileError, match="bad.model: not a readable SentencePiece model"):
        build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=str(tmp_path / "bad.model"))
    (tmp_path / "vocab.txt").write_text("hello\nworld\n")
    with pytest.raises(DataFileError, match=r"vocab.txt: WordPiece vocab lacks the special tokens \['\[UNK\]'"):
        build_tokenizer("BertWordPieceCase", vocab_file=str(tmp_path / "vocab.txt"))
    with pytest.raises(ValueError, match="needs --merge-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=gpt2_files[0])
    with pytest.raises(ValueError, match="needs --vocab-size"):
        build_tokenizer("NullTokenizer")
    with pytest.raises(ValueError, match="is not one of"):
        build_tokenizer("GPT3Tokenizer")
