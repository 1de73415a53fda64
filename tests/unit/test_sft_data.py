"""SFT data at the token level: the chat templates' learned tokens, the sample fields (padding and
packing), packed loss == the sum of the conversations run one by one, preprocessed files == JSONL."""

import dataclasses
import gzip
import json
import os

import numpy as np
import pytest
import torch

import pretrain_gpt
from megatron_lite.config import ModelConfig
from megatron_lite.data.builder import DataConfigError
from megatron_lite.data.chat_template import ConversationError, chat_tokens
from megatron_lite.data.indexed_dataset import DataFileError
from megatron_lite.data.samplers import collate
from megatron_lite.data.sft_conversations import read_conversations
from megatron_lite.data.sft_dataset import (
    SFTDataset,
    SFTDatasetConfig,
    _next_fit,
    build_sample_index,
    build_sft_datasets,
    make_sample,
)
from megatron_lite.data.sft_preprocess import preprocess_sft
from megatron_lite.data.tokenizers import build_tokenizer
from megatron_lite.parallel.state import ParallelState
from tests.model_helpers import build_gpt
from tests.sft_helpers import CHAT, hf_tokenizers, write_conversations, write_tokenizer

SEQ = 32


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    return hf_tokenizers(tmp_path_factory.mktemp("tok"))


def _learned(tokenizer, messages):
    out = chat_tokens(tokenizer, messages)
    return [tokenizer.inv_vocab[i] for i, t in zip(out.ids, out.trained) if t], out


def test_default_template_learns_assistant_text_and_eod_only(tokenizers):
    tok = tokenizers["default"]
    learned, out = _learned(tok, CHAT)
    assert learned == ["sun", "moon", "no", "<|endoftext|>"]
    text = tok.detokenize(out.ids)
    assert text.startswith("System : red User : why ? Assistant : sun moon User") and out.ids[-1] == tok.eod
    prompt = chat_tokens(tok, CHAT[:4], add_generation_prompt=True)
    assert tok.detokenize(prompt.ids).endswith("User : how Assistant :") and not any(prompt.trained)
    assert out.ids[:len(prompt.ids)] == prompt.ids  # training and generation share the prefix


def test_hf_template_learns_assistant_text_and_end_of_turn(tokenizers):
    tok = tokenizers["chatml"]
    learned, out = _learned(tok, CHAT)
    assert learned == ["sun", "moon", "<|im_end|>", "no", "<|im_end|>", "<|endoftext|>"]
    assert [tok.inv_vocab[i] for i in out.ids[:3]] == ["<|im_start|>", "system", "red"]
    prompt = chat_tokens(tok, CHAT[:4], add_generation_prompt=True)
    assert [tok.inv_vocab[i] for i in prompt.ids[-2:]] == ["<|im_start|>", "assistant"]
    assert out.ids[:len(prompt.ids)] == prompt.ids


def test_a_template_ending_with_eod_gets_no_second_one(tmp_path):
    """docs/fine-tuning.md: after the last turn comes the EOD, learned; a template that already ends
    with it gets none added (its own is learned, as the assistant turn's end)."""
    eod_turns = "{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'assistant' %} <|endoftext|>{% endif %} {% endfor %}"
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=write_tokenizer(tmp_path, eod_turns))
    learned, out = _learned(tok, CHAT)
    assert learned == ["sun", "moon", "<|endoftext|>", "no", "<|endoftext|>"]
    assert out.ids[-1] == tok.eod and out.ids[-2] != tok.eod


def test_prefix_unstable_template_is_refused(tmp_path):
    drop_history = ("{% for m in messages %}{% if loop.last or m['role'] != 'assistant' %}{{ m['content'] }} "
                    "{% endif %}{% endfor %}")
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=write_tokenizer(tmp_path, drop_history))
    with pytest.raises(ConversationError, match="prefix by prefix"):
        chat_tokens(tok, CHAT)


def test_padded_and_packed_sample_fields():
    a = (np.array([5, 6, 7, 8]), np.array([0, 0, 1, 1], dtype=bool))
    b = (np.array([9, 10, 11]), np.array([0, 1, 1], dtype=bool))
    padded = make_sample([a], 8, pad=1, pack=False)
    np.testing.assert_array_equal(padded["tokens"], [5, 6, 7, 8, 1, 1, 1, 1])
    np.testing.assert_array_equal(padded["labels"], [6, 7, 8, 1, 1, 1, 1, 1])
    np.testing.assert_array_equal(padded["loss_mask"], [0, 1, 1, 0, 0, 0, 0, 0])  # labels 7 and 8 learned
    assert "document_ids" not in padded
    packed = make_sample([a, b], 8, pad=1, pack=True)
    np.testing.assert_array_equal(packed["tokens"], [5, 6, 7, 8, 9, 10, 11, 1])
    np.testing.assert_array_equal(packed["loss_mask"], [0, 1, 1, 0, 1, 1, 0, 0])  # never across 8 -> 9
    np.testing.assert_array_equal(packed["position_ids"], [0, 1, 2, 3, 0, 1, 2, 0])
    np.testing.assert_array_equal(packed["document_ids"], [0, 0, 0, 0, 1, 1, 1, 2])
    # a conversation whose first token is learned: its label after the previous conversation's last
    # token is still not trained (a label from another document), its later ones are
    c = (np.array([12, 13]), np.array([1, 1], dtype=bool))
    packed = make_sample([a, c], 8, pad=1, pack=True)
    np.testing.assert_array_equal(packed["loss_mask"], [0, 1, 1, 0, 1, 0, 0, 0])


@pytest.fixture(scope="module")
def data(tmp_path_factory, tokenizers):
    path = write_conversations(tmp_path_factory.mktemp("sft") / "chats.jsonl", 40, seed=1, max_turns=1, max_words=3)
    return path, tokenizers["chatml"]


def _datasets(data, pack, path=None, samples=40):
    jsonl, tok = data
    cfg = SFTDatasetConfig(seq_length=SEQ, data_path=[path or jsonl], split="100,0,0", pack=pack, eod=tok.eod,
                           pad=tok.pad, seed=3)
    return build_sft_datasets(cfg, [samples, 0, 0], tok)[0], cfg


def test_packing_fills_samples_and_keeps_every_conversation(data):
    packed, _ = _datasets(data, True, samples=1)  # one epoch
    padded, _ = _datasets(data, False)
    assert len(padded) == 40 and 1 < len(packed) <= 20
    assert sorted(packed.order.tolist()) == list(range(40))  # the epoch holds each conversation once
    for i in range(len(packed)):
        sample = packed[i]
        assert sample["loss_mask"].sum() > 0 and sample["document_ids"].max() >= 1


def test_packing_puts_a_conversation_that_fills_the_sample_exactly_in_it():
    """Next-fit into seq_length + 1 tokens: conversations adding up to exactly the capacity share one sample."""
    assert _next_fit(np.array([3, 5, 8, 2, 6, 7]), 8) == [2, 1, 2, 1]
    order, bounds = build_sample_index([3, 5], [0, 1], None, 8, True, 0)
    assert sorted(order.tolist()) == [0, 1] and bounds.tolist() == [0, 2]


def test_packed_loss_equals_the_sum_of_its_conversations_one_by_one(data):
    """Token level: every packed sample's summed loss (over learned tokens) equals the sum of the
    same conversations' losses, each run alone in a padded sample (rel 1e-6)."""
    packed, cfg = _datasets(data, True)
    convs = packed.conversations
    model = build_gpt(ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                                  seq_length=SEQ, max_position_embeddings=SEQ, vocab_size=38, padded_vocab_size=40,
                                  attention_dropout=0.0, hidden_dropout=0.0, init_method_std=0.3),
                      ParallelState(), seed=3)  # large weights: attention across conversations shows

    def summed(samples):
        out, _ = pretrain_gpt.forward_step(iter([collate(samples)]), model)
        return (out * collate(samples)["loss_mask"]).sum(dim=1).double()

    for i in range(4):
        chosen = packed.order[packed.bounds[i]:packed.bounds[i + 1]]
        assert len(chosen) > 1
        alone = summed([make_sample([convs.get(int(c))], SEQ, cfg.pad, False) for c in chosen]).sum()
        together = summed([packed[i]])[0]
        assert abs(together - alone) <= 1e-6 * abs(alone), (i, together, alone)
        plain = {k: v for k, v in packed[i].items() if k != "document_ids"}  # attention across conversations
        assert abs(summed([plain])[0] - alone) > 1e-4 * abs(alone)


def test_preprocessed_files_give_the_jsonl_samples(data, tmp_path):
    jsonl, tok = data
    prefix = str(tmp_path / "chats")
    kwargs = dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=tok.path)
    result = preprocess_sft(jsonl, prefix, kwargs, workers=2, progress=False)
    assert result.conversations == 40 and 0 < result.trained_tokens < result.tokens
    for pack in (False, True):
        a, _ = _datasets(data, pack)
        b, _ = _datasets(data, pack, prefix)
        assert len(a) == len(b)
        for i in range(len(a)):
            for key, value in a[i].items():
                np.testing.assert_array_equal(b[i][key], value)


def test_preprocessed_files_without_mmap_give_the_same_samples(data, tmp_path, monkeypatch):
    """--no-mmap-bin-files reaches the SFT reader: no .bin is mapped, the samples are the same."""
    jsonl, tok = data
    prefix = str(tmp_path / "chats")
    preprocess_sft(jsonl, prefix, dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=tok.path), progress=False)
    mapped, real = [], np.memmap
    monkeypatch.setattr(np, "memmap", lambda path, *a, **kw: mapped.append(str(path)) or real(path, *a, **kw))
    a, cfg = _datasets(data, True, prefix)
    cfg = dataclasses.replace(cfg, mmap_bin_files=False)
    mapped.clear()
    b = build_sft_datasets(cfg, [40, 0, 0], tok)[0]
    assert mapped and not [p for p in mapped if p.endswith(".bin")]
    for i in range(len(a)):
        for key, value in a[i].items():
            np.testing.assert_array_equal(b[i][key], value)


def test_long_conversations_in_preprocessed_files(data, tmp_path):
    jsonl, tok = data
    prefix = str(tmp_path / "chats")
    preprocess_sft(jsonl, prefix, dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=tok.path))
    lengths = read_conversations(prefix, tok).lengths
    limit = int(np.sort(lengths)[-3])
    longer = int((lengths > limit).sum())
    assert longer >= 1
    with pytest.raises(DataConfigError, match=r"chats.bin conversation \d+: conversation is \d+ tokens"):
        read_conversations(prefix, tok, limit)
    kept = read_conversations(prefix, tok, limit, skip_bad=True)
    assert len(kept) == 40 - longer and kept.skipped["longer than the sequence"] == longer


def test_prompt_response_form_is_a_user_assistant_conversation(tmp_path, tokenizers):
    tok = tokenizers["chatml"]
    path = tmp_path / "pr.jsonl"
    path.write_text(json.dumps({"system": "red", "prompt": "why", "response": "sun"}) + "\n\n")
    conv = read_conversations(str(path), tok)
    expected = chat_tokens(tok, [{"role": "system", "content": "red"}, {"role": "user", "content": "why"},
                                 {"role": "assistant", "content": "sun"}])
    assert len(conv) == 1 and conv.get(0)[0].tolist() == expected.ids and conv.where(0).endswith("pr.jsonl:1")


@pytest.mark.parametrize("name", ["default", "chatml"])
def test_a_lone_surrogate_escape_is_read_as_pretraining_text_is(tmp_path, tokenizers, name):
    """A conversation holding "\\ud83d" (valid JSON, half an emoji): --sft and preprocess_sft.py stopped
    with a TypeError traceback from the Hugging Face tokenizer; now it is U+FFFD, as preprocess_data.py reads it."""
    tok = tokenizers[name]
    path = tmp_path / "s.jsonl"
    path.write_text('{"prompt": "why \\ud83d", "response": "sun \\ud83d", "system": "red"}\n'
                    '{"messages": [{"role": "user", "content": [{"type": "text", "text": "how \\ud83d"}]}, '
                    '{"role": "assistant", "content": "no"}]}\n')
    conv = read_conversations(str(path), tok)
    expected = chat_tokens(tok, [{"role": "system", "content": "red"}, {"role": "user", "content": "why \ufffd"},
                                 {"role": "assistant", "content": "sun \ufffd"}])
    assert len(conv) == 2 and conv.get(0)[0].tolist() == expected.ids
    assert conv.get(0)[1].tolist() == expected.trained
    preprocess_sft(str(path), str(tmp_path / "p"), dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=tok.path))
    assert read_conversations(str(tmp_path / "p"), tok).get(1)[0].tolist() == conv.get(1)[0].tolist()


def test_several_files_without_weights_blend_by_their_conversation_counts(tmp_path, tokenizers):
    """docs/fine-tuning.md: --data-path with several files weights them by their number of conversations."""
    tok = tokenizers["chatml"]
    a = write_conversations(tmp_path / "a.jsonl", 10, seed=1, max_turns=1, max_words=3)
    b = write_conversations(tmp_path / "b.jsonl", 30, seed=2, max_turns=1, max_words=3)
    cfg = SFTDatasetConfig(seq_length=SEQ, data_path=[a, b], split="100,0,0", eod=tok.eod, pad=tok.pad, seed=3)
    train = build_sft_datasets(cfg, [400, 0, 0], tok)[0]
    share = np.bincount(np.asarray(train.dataset_index), minlength=2) / len(train.dataset_index)
    assert abs(share[0] - 0.25) < 0.01, share


def test_a_weight_0_file_is_not_read_and_changes_no_sample(tmp_path, tokenizers):
    """--sft --data-path 0 tiny 1 a 3 b: tiny (2 conversations, the valid split gets none; one bad line)
    refused the run; it gives no samples, so it is not read and the samples are --data-path 1 a 3 b's."""
    tok = tokenizers["chatml"]
    a = write_conversations(tmp_path / "a.jsonl", 30, seed=1, max_turns=1, max_words=3)
    b = write_conversations(tmp_path / "b.jsonl", 30, seed=2, max_turns=1, max_words=3)
    tiny = write_conversations(tmp_path / "tiny.jsonl", 2, seed=3, max_turns=1, max_words=3)
    with open(tiny, "a") as f:
        f.write("not json\n")

    def build(data_path):
        cfg = SFTDatasetConfig(seq_length=SEQ, data_path=data_path, split="90,10,0", eod=tok.eod, pad=tok.pad, seed=3)
        return build_sft_datasets(cfg, [40, 8, 0], tok)[:2]

    for got, want in zip(build(["0", tiny, "1", a, "3", b]), build(["1", a, "3", b])):
        assert len(got) == len(want) and len(got.datasets[0]) == 0
        for i in range(len(want)):
            assert int(got[i]["dataset_id"]) == int(want[i]["dataset_id"]) + 1
            np.testing.assert_array_equal(got[i]["tokens"], want[i]["tokens"])
    with pytest.raises(DataFileError, match="missing.jsonl: file not found"):
        build(["1", a, "0", str(tmp_path / "missing.jsonl")])


def test_padding_is_the_tokenizers_pad_token_else_eod(tokenizers):
    """docs/fine-tuning.md: a padded sample is filled with the tokenizer's pad token, or the EOD without one."""
    from types import SimpleNamespace

    from megatron_lite.data.sft_dataset import sft_config_from

    config = SimpleNamespace(model=SimpleNamespace(seq_length=SEQ), training=SimpleNamespace(seed=1),
                             data=SimpleNamespace(data_path=["x.jsonl"], split="100,0,0", sft_pack_sequences=False,
                                                  sft_skip_bad_conversations=False, mmap_bin_files=True))
    tok = tokenizers["chatml"]
    assert tok.pad is not None and tok.pad != tok.eod
    assert (sft_config_from(config, tok).pad, sft_config_from(config, tok).eod) == (tok.pad, tok.eod)
    no_pad = SimpleNamespace(eod=tok.eod, pad=None)
    assert sft_config_from(config, no_pad).pad == tok.eod


def test_each_sample_of_one_split_and_sizes(data):
    jsonl, tok = data
    cfg = SFTDatasetConfig(seq_length=SEQ, data_path=[jsonl], split="90,10,0", eod=tok.eod, pad=tok.pad)
    train, valid, test = build_sft_datasets(cfg, [100, 5, 0], tok)
    assert test is None and len(train) >= 100 and len(valid) >= 5  # epochs added until enough
    assert set(train.order.tolist()) == set(range(36)) and set(valid.order.tolist()) == set(range(36, 40))
    assert isinstance(train, SFTDataset) and torch.is_tensor(collate([train[0], train[1]])["tokens"])


@pytest.mark.parametrize("damage", ["truncated", "not_gzip"])
def test_corrupt_gzip_input_is_a_data_file_error_naming_it(data, tmp_path, damage):
    """A .gz that is cut short or is not gzip at all stops the training reader and tools/preprocess_sft.py
    (1 and 2 workers) with a DataFileError naming the file (exit 2), and nothing is written."""
    jsonl, tok = data
    raw = open(jsonl, "rb").read()
    path = tmp_path / "chats.jsonl.gz"
    path.write_bytes(gzip.compress(raw * 20)[:-200] if damage == "truncated" else raw)
    where = r"after line \d+" if damage == "truncated" else "from its start"
    with pytest.raises(DataFileError, match=rf"chats\.jsonl\.gz: cannot be read {where} .*\(--data-path\)"):
        read_conversations(str(path), tok)
    kwargs = dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=tok.path)
    for workers in (1, 2):
        with pytest.raises(DataFileError, match=rf"chats\.jsonl\.gz: cannot be read {where} .*\(--input\)"):
            preprocess_sft(str(path), str(tmp_path / "out"), kwargs, workers=workers, progress=False)
        assert not list(tmp_path.glob("out*"))


def test_a_pool_terminate_that_never_returns_does_not_hang_preprocess_sft(data, tmp_path, monkeypatch):
    """CPython's Pool.terminate can wait forever for its task-feeding thread (a large task half written
    into a pipe no worker reads any more; see megatron_lite.data.worker_pool.stop_pool): with 2 workers a
    bad line still ends preprocess_sft with its error while terminate is stuck, and nothing is written."""
    import multiprocessing.pool
    import threading

    import megatron_lite.data.worker_pool as worker_pool

    jsonl, tok = data
    bad = tmp_path / "bad.jsonl"
    bad.write_text(open(jsonl).read() + "{not json\n")
    monkeypatch.setattr(worker_pool, "POOL_STOP_SECONDS", 0.5)
    real_terminate, release, returned = multiprocessing.pool.Pool.terminate, threading.Event(), []

    def terminate_then_hang(self):
        real_terminate(self)
        release.wait(20)  # as CPython's join of a blocked thread does (bounded, so the test ends without the fix)
        returned.append(self)

    monkeypatch.setattr(multiprocessing.pool.Pool, "terminate", terminate_then_hang)
    kwargs = dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=tok.path)
    with pytest.raises(DataConfigError, match=r"bad\.jsonl:41: not valid JSON"):
        preprocess_sft(str(bad), str(tmp_path / "out"), kwargs, workers=2, progress=False)
    assert not returned  # the error came while terminate was still stuck
    release.set()
    assert not list(tmp_path.glob("out*"))


def test_json_nested_too_deeply_is_a_bad_line(tmp_path, tokenizers):
    """A corrupt line of a million '[' made json.loads raise RecursionError: a traceback instead of
    the file:line message (and not skippable with --sft-skip-bad-conversations)."""
    tok = tokenizers["chatml"]
    path = tmp_path / "deep.jsonl"
    path.write_text(json.dumps({"prompt": "why", "response": "sun"}) + "\n" + "[" * 1_000_000 + "\n")
    with pytest.raises(DataConfigError, match=r"deep\.jsonl:2: not valid JSON \(nested too deeply"):
        read_conversations(str(path), tok)
    kept = read_conversations(str(path), tok, skip_bad=True)
    assert len(kept) == 1 and kept.skipped["not JSON"] == 1


def test_preprocess_sft_refuses_null_tokenizer(tmp_path, capsys, data):
    """tools/preprocess_sft.py --tokenizer-type NullTokenizer: one line and exit 2, as --sft refuses it
    (was a ValueError traceback from tokenizing 'User: ...'); nothing written."""
    from tests.tools import load_tool

    jsonl, _ = data
    out = tmp_path / "out"
    code = load_tool("preprocess_sft").main(["--input", jsonl, "--output-prefix", str(out), "--tokenizer-type",
                                             "NullTokenizer", "--vocab-size", "100", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "NullTokenizer" in err, err
    assert not list(tmp_path.glob("out*"))


@pytest.mark.parametrize("workers", ["0", "-2"])
def test_preprocess_sft_refuses_workers_below_one(tmp_path, tokenizers, workers):
    """--workers 0 (or negative) hung forever: the chunk gate admitted 4 x workers = 0 chunks. It is
    one line naming the flag, exit code 2, nothing written (run as a process: a hang fails it)."""
    import subprocess
    import sys

    jsonl = write_conversations(tmp_path / "c.jsonl", 3)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    argv = [sys.executable, os.path.join(root, "tools", "preprocess_sft.py"), "--input", str(jsonl), "--output-prefix",
            str(tmp_path / "out"), "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
            tokenizers["chatml"].path, "--workers", workers, "--no-progress"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=root)
    assert done.returncode == 2 and done.stderr.strip() == f"error: --workers {workers} must be at least 1", done.stderr
    assert not list(tmp_path.glob("out*"))
