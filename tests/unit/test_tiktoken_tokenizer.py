"""TikTokenizer and Llama2Tokenizer (Megatron-LM's types): the id layout worked out by hand from a
vocabulary file written here, exact round trips (non-ASCII, emoji, special tokens' text), both split
patterns, the tool path, and every bad file or flag as one line naming it."""

import base64
import json
import sys

import pytest

from megatron_lite.data.chat_template import encode
from megatron_lite.data.indexed_dataset import DataFileError, IndexedDataset
from megatron_lite.data.tiktoken_tokenizer import PATTERN_V2
from megatron_lite.data.tokenizers import build_tokenizer
from megatron_lite.errors import ConfigError
from tests.cli_errors import refused_line
from tests.preprocess_helpers import make_tok_files, run, texts, write_tiktoken_vocab
from tests.tools import load_tool

WORDS = (" the", "the", " of", "ing", " café", "日本", "oW", "🙂")
ROUND_TRIP = [
    "the café of 日本 and thing", "HelloWorld oWn", "  leading and trailing  \n\n\ttabs\r\n",
    "emoji 🙂🚀 ©® ∑∫ Ångström — “quotes”", "</s> <s> <unk> <SPECIAL_7> are text here", "", " ",
    "numbers 0 12 123456 -3.5", "\x00\x01 control \x7f",
]


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tik") / "vocab.json")
    return path, write_tiktoken_vocab(path, WORDS)


def tik(path, size, pattern="v2", **kw):
    return build_tokenizer("TikTokenizer", tokenizer_model=path, tiktoken_pattern=pattern, vocab_size=size, **kw)


def test_ids_are_the_special_tokens_then_the_ranks_offset_by_their_number(vocab):
    path, n = vocab
    t = tik(path, 1000 + n)  # Megatron's default: 1000 special ids
    assert (t.unk, t.bos, t.eos, t.eod, t.pad, t.vocab_size) == (0, 1, 2, 2, None, 1000 + n)
    assert t.inv_vocab[3] == "<SPECIAL_3>" and t.inv_vocab[999] == "<SPECIAL_999>"
    assert t.tokenize("a") == [1000 + ord("a")]  # rank 97 (the byte) at id 1000 + 97
    # after the bytes: " t", " th", " the" (WORDS[0]'s prefixes), "th", "the": rank 260
    assert t.tokenize("the") == [1000 + 260] and t.tokenize(" the") == [1000 + 258]
    assert t.vocab[b"the"] == 1260 and t.inv_vocab[1260] == "the" and t.vocab["</s>"] == 2
    assert t.tokenize("the", bos=True, eos=True) == [1, 1260, 2]
    # a shorter --vocab-size cuts the file's ranks; a list of one's own sets the first ids
    small = tik(path, 8 + 259, tiktoken_num_special_tokens=8,
                tiktoken_special_tokens=["<pad>", "<s>", "</s>", "<unk>", "<mask>"])
    assert (small.pad, small.bos, small.eos, small.unk, small.vocab_size) == (0, 1, 2, 3, 267)
    assert small.inv_vocab[5] == "<SPECIAL_5>" and small.tokenize("a") == [8 + 97]
    assert small.tokenize("the") == [8 + 116, 8 + 104, 8 + 101]  # "th" (rank 259) is cut off
    assert all(small.detokenize(small.tokenize(x)) == x and max(small.tokenize(x), default=0) < 267 for x in ROUND_TRIP)


@pytest.mark.parametrize("pattern", ["v1", "v2"])
def test_round_trips_and_special_tokens_as_megatron(vocab, pattern):
    path, n = vocab
    t = tik(path, 1000 + n, pattern)
    for text in ROUND_TRIP:
        ids = t.tokenize(text)
        assert t.detokenize(ids) == text, text
        assert all(1000 <= i < 1000 + n for i in ids)  # a special token's text is ordinary text (encode_ordinary)
    assert t.detokenize([t.bos, *t.tokenize("hi"), t.eos, 7]) == "<s>hi</s><SPECIAL_7>"
    assert t.detokenize(t.tokenize("日本")[:1]) == "日本"  # one token of 6 bytes
    assert t.detokenize([1000 + 0xE6]) == "\ufffd"  # a lone lead byte: replaced, not an exception
    with pytest.raises(ValueError, match="outside the TikTokenizer vocabulary"):
        t.detokenize([1000 + n])
    # v1 splits letters as one run, v2 at a lower-to-upper case change: the token "oW" is used by v1 only
    assert (t.vocab[b"oW"] in t.tokenize("HelloWorld")) == (pattern == "v1")


def test_the_v2_pattern_is_megatron_lms():
    upper, lower = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
    assert PATTERN_V2 == (rf"[^\r\n\p{{L}}\p{{N}}]?{upper}*{lower}+|[^\r\n\p{{L}}\p{{N}}]?{upper}+{lower}*|\p{{N}}"
                          r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def test_a_tekken_json_object_is_read_for_its_vocab_list(vocab, tmp_path):
    path, n = vocab
    tekken = tmp_path / "tekken.json"
    tekken.write_text(json.dumps({"config": {"pattern": "ignored"}, "vocab": json.load(open(path))}))
    assert tik(str(tekken), 1000 + n).tokenize("the café") == tik(path, 1000 + n).tokenize("the café")


def _entries(n=300):
    return [{"rank": i, "token_bytes": base64.b64encode(bytes([i % 256]) * (1 + i // 256)).decode(), "token_str": ""}
            for i in range(n)]


@pytest.mark.parametrize("content, words", [
    ("{not json", "not a readable TikTokenizer vocabulary"),
    (json.dumps({"a": 1}), "expected a JSON list"),
    (json.dumps(_entries(100)), "100 tokens, fewer than the 300 --vocab-size 1300"),
    (json.dumps([{**e, "rank": e["rank"] + (e["rank"] == 5)} for e in _entries()]), "entry 5 is not"),
    (json.dumps([{**e, "token_bytes": "!!"} if e["rank"] == 9 else e for e in _entries()]), "entry 9: token_bytes"),
    (json.dumps(_entries(301)[1:]), "entry 0 is not"),
    (json.dumps([{**e, "token_bytes": "YQ=="} if e["rank"] == 3 else e for e in _entries()]),
     "entry 3 must be the single byte 3"),
    (json.dumps([{**e, "token_bytes": "AAA="} if e["rank"] == 299 else e for e in _entries()]),
     "entry 299 repeats the token of entry 256"),
], ids=["json", "object", "short", "rank", "base64", "first", "byte", "repeat"])
def test_a_bad_vocabulary_file_is_one_line_naming_it(tmp_path, content, words):
    (tmp_path / "v.json").write_text(content)
    with pytest.raises(DataFileError, match="v.json: ") as err:
        tik(str(tmp_path / "v.json"), 1300)
    assert words in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("kw, words", [
    (dict(tiktoken_pattern=None), "needs --tiktoken-pattern v1 or v2 (it has no default: "),
    (dict(tiktoken_special_tokens=["<unk>", "<s>"]), "must include <unk> <s> </s> (missing </s>)"),
    (dict(tiktoken_special_tokens=["<unk>", "<s>", "</s>", "<s>"]), "listed twice"),
    (dict(tiktoken_num_special_tokens=2), "--tiktoken-num-special-tokens 2 must be at least the 3"),
    (dict(tiktoken_num_special_tokens=1100), "the 256 byte tokens need at least --vocab-size 1356"),
    (dict(tiktoken_special_tokens=["<unk>", "<s>", "</s>", "<SPECIAL_4>"]), "<SPECIAL_4> is the name of a filler"),
])
def test_bad_tiktoken_flags_are_config_errors_naming_the_flag(vocab, kw, words):
    path, n = vocab
    args = dict(tiktoken_pattern="v2", **kw) if "tiktoken_pattern" not in kw else kw
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        build_tokenizer("TikTokenizer", tokenizer_model=path, vocab_size=1000 + n, **args)


def test_tiktoken_flags_with_another_type_are_refused_and_a_missing_package_named(vocab, monkeypatch):
    with pytest.raises(ConfigError, match="--tiktoken-pattern applies to --tokenizer-type TikTokenizer only"):
        build_tokenizer("NullTokenizer", vocab_size=10, tiktoken_pattern="v1")
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    with pytest.raises(ConfigError, match=r"pip install megatron_lite\[tiktoken\]"):
        tik(vocab[0], 1000 + vocab[1])


def test_training_without_the_package_or_with_a_corrupt_file_is_one_line(vocab, tmp_path, capsys, monkeypatch):
    import pretrain_gpt

    path, n = vocab
    argv = ["--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "2", "--seq-length", "8",
            "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1", "--mock-data",
            "--tokenizer-type", "TikTokenizer", "--tiktoken-pattern", "v1", "--vocab-size", str(1000 + n)]
    (tmp_path / "cut.json").write_text(open(path).read()[:-20])
    refused_line(capsys, lambda: pretrain_gpt.main(argv + ["--tokenizer-model", str(tmp_path / "cut.json")]),
                 "cut.json: not a readable TikTokenizer vocabulary")
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    refused_line(capsys, lambda: pretrain_gpt.main(argv + ["--tokenizer-model", path]), "megatron_lite[tiktoken]")


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    return make_tok_files(tmp_path_factory)["GPTSentencePieceTokenizer"]["tokenizer_model"]


def test_llama2_puts_the_bos_first_and_is_otherwise_the_models_pieces(spm):
    llama = build_tokenizer("Llama2Tokenizer", tokenizer_model=spm)
    gpt = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=spm)
    assert (llama.bos, llama.eos, llama.eod, llama.vocab_size) == (gpt.bos, gpt.eos, gpt.eos, gpt.vocab_size)
    for text in ROUND_TRIP[:-1]:
        ids = llama.tokenize(text)
        assert ids == [gpt.bos, *gpt.tokenize(text)] and llama.detokenize(ids) == text, text
    assert llama.tokenize("a b", bos=False, eos=True) == [*gpt.tokenize("a b"), gpt.eos]
    assert encode(llama, "a b") == gpt.tokenize("a b")  # a chat template's pieces: no BOS in the middle


def test_preprocess_with_both_types(tmp_path, vocab, spm):
    path, n = vocab
    tik_args = dict(tokenizer_type="TikTokenizer", tokenizer_model=path, vocab_size=1000 + n, tiktoken_pattern="v1",
                    tiktoken_num_special_tokens=1000, tiktoken_special_tokens=None)
    t = tik(path, 1000 + n, "v1")
    out = run(tmp_path, tik_args, "tik", append_eod=True).outputs[0]
    docs = IndexedDataset(out)
    assert [list(docs[i]) for i in range(2)] == [t.tokenize(x) + [2] for x in texts()[:2]]
    out = run(tmp_path, dict(tokenizer_type="Llama2Tokenizer", tokenizer_model=spm), "llama", append_eod=True).outputs[0]
    llama = build_tokenizer("Llama2Tokenizer", tokenizer_model=spm)
    assert list(IndexedDataset(out)[0]) == [llama.bos, *llama.tokenize(texts()[0], bos=False), llama.eos]


def test_preprocess_tool_takes_the_flags_and_refuses_a_corrupt_vocabulary_in_one_line(tmp_path, vocab, capsys):
    path, n = vocab
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"text": "the café 🙂"}) + "\n", encoding="utf-8")
    tool = load_tool("preprocess_data")
    argv = ["--input", str(src), "--tokenizer-type", "TikTokenizer", "--tiktoken-pattern", "v2", "--vocab-size",
            str(1000 + n), "--tiktoken-num-special-tokens", "1000", "--tiktoken-special-tokens", "<unk>", "<s>", "</s>"]
    assert tool.main(argv + ["--tokenizer-model", path, "--output-prefix", str(tmp_path / "ok")]) == 0
    assert IndexedDataset(str(tmp_path / "ok_text_document")).num_tokens == len(tik(path, 1000 + n).tokenize("the café 🙂"))
    (tmp_path / "broken.json").write_text('[{"rank": 0, "token_bytes": "AA=="}, {"rank": 7}]')
    capsys.readouterr()
    assert tool.main(argv + ["--tokenizer-model", str(tmp_path / "broken.json"),
                             "--output-prefix", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "broken.json" in err[0], err
    assert not list(tmp_path.glob("bad*"))


@pytest.mark.parametrize("kind", ["TikTokenizer", "Llama2Tokenizer"])
def test_hugging_face_export_says_it_writes_no_tokenizer_for_these_types(tmp_path, kind):
    from megatron_lite.checkpoint.hf_tokenizer import export_tokenizer

    special, line = export_tokenizer({"tokenizer_type": kind, "tokenizer_model": "/x/tok"}, {}, str(tmp_path))
    assert special == {} and line.startswith(f"tokenizer: {kind} not written") and "/x/tok" in line
    assert list(tmp_path.iterdir()) == []
