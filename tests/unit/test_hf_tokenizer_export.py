"""Hugging Face export of every tokenizer type: AutoTokenizer on the exported folder gives exactly
the ids our tokenizer gives (GPT-2 BPE, SentencePiece BPE and unigram both as GPTSentencePiece and
as Megatron's SentencePieceTokenizer with its appended special tokens, a tokenizer.json, BERT
WordPiece lower-cased and cased); the special-token ids go to config.json; a tokenizer Hugging
Face would read differently is not written. Texts holding a special token's literal string are
left out: Hugging Face reads those as the special token (documented)."""

import json
import os

import pytest

from megatron_lite.checkpoint import hf_tokenizer
from megatron_lite.checkpoint.hf_tokenizer import export_tokenizer, tokenizer_in_folder
from megatron_lite.data.tokenizers import build_tokenizer
from megatron_lite.data.wordpiece import save_vocab, train_wordpiece
from tests.tools import load_tool
from tests.unit.test_tokenizers import TRICKY, corpus_texts

transformers = pytest.importorskip("transformers")
FIXTURES = os.path.join(os.path.dirname(__file__), os.pardir, "fixtures")


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory):
    """{case: (tokenizer type, files as the export gets them)} for every tokenizer type."""
    d = tmp_path_factory.mktemp("tok")
    train = load_tool("train_tokenizer")
    out = {"gpt2": ("GPT2BPETokenizer", {"vocab.json": os.path.join(FIXTURES, "gpt2", "vocab.json"),
                                         "merges.txt": os.path.join(FIXTURES, "gpt2", "merges.txt")})}
    for model_type, size in (("bpe", 600), ("unigram", 500)):
        model = train.train_sentencepiece(corpus_texts() * 2, str(d / model_type), vocab_size=size, model_type=model_type)
        for kind in ("GPTSentencePieceTokenizer", "SentencePieceTokenizer"):
            out[f"{kind}-{model_type}"] = (kind, {"tokenizer.model": model})
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers

    hf = tokenizers.Tokenizer(models.BPE.from_file(*(out["gpt2"][1][n] for n in ("vocab.json", "merges.txt"))))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    hf.save(str(d / "tokenizer.json"))
    out["tokenizer.json"] = ("HuggingFaceTokenizer", {"tokenizer.json": str(d / "tokenizer.json")})
    for kind, lower in (("BertWordPieceLowerCase", True), ("BertWordPieceCase", False)):
        save_vocab(train_wordpiece(corpus_texts() * 2, 400, lower_case=lower), str(d / f"{kind}.txt"))
        out[kind] = (kind, {"vocab.txt": str(d / f"{kind}.txt")})
    return out


def _ours(kind, files):
    model = files.get("tokenizer.json") or files.get("tokenizer.model")
    return build_tokenizer(kind, vocab_file=files.get("vocab.json") or files.get("vocab.txt"),
                           merge_file=files.get("merges.txt"), tokenizer_model=model)


CASES = ["gpt2", "GPTSentencePieceTokenizer-bpe", "GPTSentencePieceTokenizer-unigram", "SentencePieceTokenizer-bpe",
         "SentencePieceTokenizer-unigram", "tokenizer.json", "BertWordPieceLowerCase", "BertWordPieceCase"]


@pytest.mark.parametrize("case", CASES)
def test_auto_tokenizer_on_the_export_gives_our_ids(tokenizer_files, case, tmp_path):
    kind, files = tokenizer_files[case]
    ours = _ours(kind, files)
    special, note = export_tokenizer({"tokenizer_type": kind, "vocab_size": ours.vocab_size}, files, str(tmp_path))
    assert "AutoTokenizer gives the training ids" in note, note
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    literal = [t for t in auto.all_special_tokens if t]
    texts = [t for t in corpus_texts() + TRICKY if not any(s in t for s in literal)]
    assert len(texts) > 10
    bert = kind.startswith("Bert")
    for text in texts:
        want = ours.tokenize(text)
        assert auto.encode(text, add_special_tokens=False) == want, text
        assert auto.encode(text) == ([ours.cls, *want, ours.sep] if bert else want), text  # no BOS added to GPT text
    if bert:
        assert special == {"pad_token_id": ours.pad}
    else:
        assert special["eos_token_id"] == ours.eod and auto.convert_tokens_to_ids(auto.eos_token) == ours.eod
        assert special["bos_token_id"] == (ours.bos if ours.bos is not None else ours.eod)
    if kind == "SentencePieceTokenizer":  # Megatron's appended tokens keep their ids and stay whole
        for token, i in ours.special.items():
            assert auto.convert_tokens_to_ids(token) == i
    assert tokenizer_in_folder(str(tmp_path))["tokenizer_type"] in (kind, "HuggingFaceTokenizer")


def test_a_tokenizer_hugging_face_would_read_differently_is_not_written(tokenizer_files, tmp_path, monkeypatch):
    kind, files = tokenizer_files["GPTSentencePieceTokenizer-bpe"]
    ours = _ours(kind, files)
    real = hf_tokenizer._ours

    def shifted(config, files):  # a tokenizer whose ids differ from what its files say
        tok = real(config, files)
        tok.tokenize = lambda text: [i + 1 for i in tok.sp.encode_as_ids(text)]
        return tok

    monkeypatch.setattr(hf_tokenizer, "_ours", shifted)
    special, note = export_tokenizer({"tokenizer_type": kind, "vocab_size": ours.vocab_size}, files, str(tmp_path))
    assert "not written: Hugging Face would read it with other ids" in note and "\n" not in note
    assert os.listdir(tmp_path) == []  # nothing half-written
    assert special["eos_token_id"] == ours.eod  # the ids for config.json are still right
    _, note = export_tokenizer({"tokenizer_type": kind, "vocab_size": 50}, files, str(tmp_path))
    assert "not written" in note and "50" in note


def test_without_a_tokenizer_the_end_of_document_is_the_last_id(tmp_path):
    special, note = export_tokenizer({"tokenizer_type": None, "vocab_size": 101}, {}, str(tmp_path))
    assert special == {"bos_token_id": 100, "eos_token_id": 100} and "none" in note
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "X"}))
    special, note = export_tokenizer({"vocab_size": 101}, {"tokenizer_config.json": str(tmp_path / "src" /
                                                                                          "tokenizer_config.json")},
                                     str(tmp_path / "out"))
    assert special == {} and (tmp_path / "out" / "tokenizer_config.json").is_file()  # a Hugging Face source: kept


@pytest.mark.parametrize("case", ["gpt2", "GPTSentencePieceTokenizer-bpe", "SentencePieceTokenizer-unigram",
                                  "tokenizer.json", "tokenizer.json folder"])
def test_a_trained_checkpoint_exports_a_tokenizer_auto_tokenizer_reads_back(tokenizer_files, case, tmp_path, capsys):
    """End to end, as the issue's user did: pretrain_gpt.py with a tokenizer, convert.py --saver hf;
    AutoTokenizer on the export gives the training ids and config.json / generation_config.json
    carry our end-of-document id (transformers' default 50256 lies outside these vocabularies).
    ``tokenizer.json folder``: ``--tokenizer-model`` names the folder holding tokenizer.json, as
    docs/fine-tuning.md does (``--tokenizer-model hf/my-llama``); the export wrote no tokenizer then."""
    import pretrain_gpt
    from tests.convert_helpers import convert

    kind, files = tokenizer_files[case.removesuffix(" folder")]
    ours = _ours(kind, files)
    flags = {"tokenizer.model": "--tokenizer-model", "tokenizer.json": "--tokenizer-model", "vocab.json": "--vocab-file",
             "merges.txt": "--merge-file"}
    if case.endswith(" folder"):
        files = {name: os.path.dirname(path) for name, path in files.items()}
    tokenizer = ["--tokenizer-type", kind, "--vocab-size", str(ours.vocab_size)] + [x for name, path in files.items() for x in (flags[name], path)]
    ckpt, hf = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    pretrain_gpt.main(["--mock-data", "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
                       "--seq-length", "8", "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1",
                       "--eval-iters", "0", "--lr", "1e-3", "--save", ckpt] + tokenizer)
    assert convert("GPT", "--saver", "hf", "--load-dir", ckpt, "--save-dir", hf) == 0
    assert "AutoTokenizer gives the training ids" in capsys.readouterr().out
    auto = transformers.AutoTokenizer.from_pretrained(hf)
    for text in corpus_texts()[:20]:
        assert auto.encode(text) == ours.tokenize(text), text
    config = transformers.AutoConfig.from_pretrained(hf)
    generation = transformers.GenerationConfig.from_pretrained(hf)
    assert config.eos_token_id == generation.eos_token_id == ours.eod < ours.vocab_size
    assert config.bos_token_id == (ours.bos if ours.bos is not None else ours.eod)


def test_a_tokenizer_json_that_adds_a_bos_is_exported_with_it(tokenizer_files, tmp_path):
    """A Llama-style tokenizer.json whose post-processor puts a BOS before every text (and a
    tokenizer_config.json naming it): AutoTokenizer reads the export exactly as we do, with the BOS
    and without it when special tokens are off, and config.json's bos_token_id is that BOS. The export
    refused it ("'Hello world' gives [50257, 15496, 995] there, [50257, 15496, 995] here": the same ids,
    since only our ids without special tokens were compared) and named the end of document as BOS."""
    from tokenizers import Tokenizer, processors

    folder = tmp_path / "llama_like"
    folder.mkdir()
    hf = Tokenizer.from_file(tokenizer_files["tokenizer.json"][1]["tokenizer.json"])
    hf.add_special_tokens(["<s>", "</s>"])
    bos = hf.token_to_id("<s>")
    hf.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    hf.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    files = {"tokenizer.json": str(folder / "tokenizer.json")}
    ours = _ours("HuggingFaceTokenizer", files)
    assert ours.tokenize("Hello world")[0] == bos and ours.bos == bos
    out = tmp_path / "out"
    out.mkdir()
    special, note = export_tokenizer({"tokenizer_type": "HuggingFaceTokenizer", "vocab_size": ours.vocab_size}, files,
                                     str(out))
    assert "AutoTokenizer gives the training ids" in note, note
    auto = transformers.AutoTokenizer.from_pretrained(str(out))
    for text in corpus_texts()[:20]:
        assert auto.encode(text) == ours.tokenize(text), text
        assert auto.encode(text, add_special_tokens=False) == ours.tokenize(text)[1:], text
    assert special["bos_token_id"] == bos == auto.bos_token_id
    assert special["eos_token_id"] == ours.eod == auto.eos_token_id == hf.token_to_id("</s>")


def test_an_import_keeps_the_chat_template_that_transformers_saves_beside_the_tokenizer(tmp_path, capsys):
    """transformers saves a tokenizer's chat template as chat_template.jinja; an import left that file
    behind, so a fine-tune with the printed --tokenizer-model silently used the default template
    instead of the model's. The import keeps it, and exporting the import back keeps it too."""
    import torch

    from megatron_lite.data.chat_template import chat_tokens
    from tests.convert_helpers import convert
    from tests.sft_helpers import CHATML, VOCAB, write_tokenizer

    src = tmp_path / "hf"
    transformers.AutoTokenizer.from_pretrained(write_tokenizer(tmp_path / "tok", CHATML)).save_pretrained(str(src))
    assert (src / "chat_template.jinja").is_file()  # where transformers puts it
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=len(VOCAB), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=16)).save_pretrained(str(src))
    assert convert("GPT", "--loader", "hf", "--saver", "megatron", "--load-dir", str(src),
                   "--save-dir", str(tmp_path / "imp")) == 0
    found = tokenizer_in_folder(str(tmp_path / "imp" / "tokenizer"))
    chat = [{"role": "user", "content": "why ?"}, {"role": "assistant", "content": "sun"}]
    want = chat_tokens(build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(src)), chat)
    got = chat_tokens(build_tokenizer(**found), chat)
    assert (got.ids, got.trained) == (want.ids, want.trained)
    assert convert("GPT", "--saver", "hf", "--load-dir", str(tmp_path / "imp"), "--save-dir", str(tmp_path / "back")) == 0
    assert transformers.AutoTokenizer.from_pretrained(str(tmp_path / "back")).chat_template == CHATML


def test_an_export_keeps_the_chat_template_the_run_trained_with(tmp_path):
    """A fine-tune with a HuggingFaceTokenizer whose folder holds a chat template (--sft renders the
    conversations with it): the export wrote a tokenizer_config.json without it, so
    apply_chat_template on the exported model failed or prompted it otherwise than it was trained.
    It now carries the template: Hugging Face's generation prompt has our ids."""
    from megatron_lite.data.chat_template import chat_tokens
    from tests.sft_helpers import CHATML, write_tokenizer

    folder = write_tokenizer(tmp_path / "tok", CHATML)
    files = {"tokenizer.json": os.path.join(folder, "tokenizer.json")}
    ours = _ours("HuggingFaceTokenizer", files)
    out = tmp_path / "out"
    out.mkdir()
    _, note = export_tokenizer({"tokenizer_type": "HuggingFaceTokenizer", "vocab_size": ours.vocab_size}, files, str(out))
    assert "AutoTokenizer gives the training ids" in note, note
    auto = transformers.AutoTokenizer.from_pretrained(str(out))
    chat = [{"role": "system", "content": "red"}, {"role": "user", "content": "why ?"}]
    want = auto.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    assert chat_tokens(ours, chat, add_generation_prompt=True).ids == list(want["input_ids"] if hasattr(want, "keys") else want)


BERT_PAIR = ("The quick brown fox jumps over the lazy dog.", "numbers 0 12 123456 3.14159 -42")


def bert_layout(ours, a: str, b: str | None = None) -> tuple[list[int], list[int]]:
    """(ids, token types) of a sample as megatron_lite/data/bert_dataset.py lays it out:
    [CLS] A [SEP] (B [SEP]), types 0 up to the first [SEP] and 1 after it."""
    ta, tb = ours.tokenize(a), ours.tokenize(b) if b is not None else []
    ids = [ours.cls, *ta, ours.sep] + ([*tb, ours.sep] if b is not None else [])
    return ids, [0] * (len(ta) + 2) + [1] * (len(ids) - len(ta) - 2)


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_a_bert_sentencepiece_tokenizer_exports_with_its_special_tokens_and_pairs(tokenizer_files, tmp_path, model_type):
    """A BERT trained with Megatron's SentencePieceTokenizer (<CLS> <SEP> <MASK> appended) was exported as a
    GPT tokenizer: no mask / cls / sep token (a fill-mask pipeline cannot run), and encode() added no
    <CLS> ... <SEP>. The export carries them and a BERT post-processor: AutoTokenizer encodes a text and a
    pair exactly as our BERT dataset lays out a sample, token types included."""
    kind, files = tokenizer_files[f"SentencePieceTokenizer-{model_type}"]
    ours = _ours(kind, files)
    special, note = export_tokenizer({"tokenizer_type": kind, "vocab_size": ours.vocab_size,
                                      "bert_no_binary_head": False}, files, str(tmp_path))
    assert "AutoTokenizer gives the training ids" in note, note
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert (auto.cls_token, auto.sep_token, auto.mask_token) == ("<CLS>", "<SEP>", "<MASK>")
    assert (auto.cls_token_id, auto.sep_token_id, auto.mask_token_id, auto.pad_token_id, auto.unk_token_id) == (
        ours.cls, ours.sep, ours.mask, ours.pad, ours.sp.unk_id())
    assert special == {"pad_token_id": ours.pad}
    for a, b in (BERT_PAIR, BERT_PAIR[::-1]):
        ids, types = bert_layout(ours, a, b)
        pair = auto(a, b)
        assert (pair["input_ids"], pair["token_type_ids"]) == (ids, types)
        one = auto(a)
        assert (one["input_ids"], one["token_type_ids"]) == bert_layout(ours, a)
        assert auto.encode(a, add_special_tokens=False) == ours.tokenize(a)


def test_a_trained_bert_with_sentencepiece_exports_a_tokenizer_fill_mask_can_use(tokenizer_files, tmp_path):
    """End to end: a BERT checkpoint saved with --tokenizer-type SentencePieceTokenizer, convert.py --saver hf;
    transformers' fill-mask pipeline runs on the export (it needs the mask token) and the tokenizer
    reads a pair as the training data did."""
    from megatron_lite.checkpoint import save_checkpoint
    from megatron_lite.config import Config, ModelConfig
    from megatron_lite.models import BertModel, TransformerConfig
    from megatron_lite.parallel.state import ParallelState
    from megatron_lite.parallel.tensor import padded_vocab_size
    from pretrain_bert import BertConfig
    from tests.convert_helpers import convert

    kind, files = tokenizer_files["SentencePieceTokenizer-unigram"]
    ours = _ours(kind, files)
    model = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, seq_length=32,
                        max_position_embeddings=32, vocab_size=ours.vocab_size, make_vocab_size_divisible_by=8)
    model.padded_vocab_size = padded_vocab_size(ours.vocab_size, 8, 1)
    run = Config(model=model, extra_sections=("bert",))
    run.bert, run.fusion.bias_gelu_fusion = BertConfig(), False  # exact GeLU: megatron-bert's
    run.data.tokenizer_type, run.data.tokenizer_model = kind, files["tokenizer.model"]
    run.checkpoint.save = str(tmp_path / "src")
    state = ParallelState()
    save_checkpoint(1, [BertModel(TransformerConfig.from_model(model), state).eval()], None, None, 1, run, state)
    hf = str(tmp_path / "hf")
    assert convert("BERT", "--saver", "hf", "--load-dir", tmp_path / "src", "--save-dir", hf) == 0
    auto = transformers.AutoTokenizer.from_pretrained(hf)
    assert auto.mask_token_id == ours.mask
    assert auto(*BERT_PAIR)["input_ids"] == bert_layout(ours, *BERT_PAIR)[0]
    fill = transformers.pipeline("fill-mask", model=hf, tokenizer=hf)
    assert len(fill(f"the quick {auto.mask_token} fox", top_k=2)) == 2
