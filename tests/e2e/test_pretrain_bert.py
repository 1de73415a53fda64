"""pretrain_bert.py through its command line, on a WordPiece --split-sentences dataset built here.

The data is made the README's way from tests/fixtures/tiny_corpus.jsonl: train_tokenizer.py
--model-type wordpiece, then preprocess_data.py --split-sentences. Parallel runs call
``pretrain_bert.main(argv)`` on every rank of a reused gloo pool; the reference is ``main(argv)`` in
this process. Same seed, same global batch, dropout 0, fp32: both reported losses (``lm loss``,
``sop loss``) and the gradient norm of every step must agree within a relative 1e-5, and the final weights, merged from
the saved checkpoints, as test_pretrain_gpt.py's assert_same_weights says.
"""

import os
import re
import subprocess
import sys

import pytest
import torch

import pretrain_bert
from megatron_lite.checkpoint import load_bert_checkpoint, merge_checkpoint
from megatron_lite.data.tokenizers import build_tokenizer
from megatron_lite.lora.apply import is_adapter_name
from tests.cli_errors import refused_line
from tests.e2e.test_pretrain_gpt import assert_same_weights
from tests.tools import load_tool
from tests.trajectory import Trajectory, assert_same_trajectory, ranks_trajectory, run_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORPUS = os.path.join(ROOT, "tests", "fixtures", "tiny_corpus.jsonl")
ITERS = 6  # past the 2 warm-up steps; the resume stops at 4 and continues 2
VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.bias")


def _tool(*argv):
    subprocess.run([sys.executable, *argv], cwd=ROOT, check=True, capture_output=True, text=True)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("bert_data")
    _tool("tools/train_tokenizer.py", "--input", CORPUS, "--output-prefix", str(d / "wp"), "--model-type", "wordpiece",
          "--vocab-size", "300")
    tok = ["--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", str(d / "wp-vocab.txt")]
    _tool("tools/preprocess_data.py", "--input", CORPUS, "--output-prefix", str(d / "tiny"), "--split-sentences", *tok)
    _tool("tools/preprocess_data.py", "--input", CORPUS, "--output-prefix", str(d / "tiny"), *tok)
    return {"sentence": str(d / "tiny_text_sentence"), "document": str(d / "tiny_text_document"), "tok": tok,
            "dir": d}


def _argv(data, save, iters=ITERS, extra=()):
    return [
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
        "--make-vocab-size-divisible-by", "8", "--attention-dropout", "0", "--hidden-dropout", "0",
        "--lr", "5e-3", "--lr-warmup-iters", "2", "--log-interval", "1", "--eval-iters", "0", "--seed", "7",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(iters), "--split", "100,0,0",
        "--data-path", data["sentence"], *data["tok"], "--data-cache-path", str(data["dir"] / "cache"),
        "--save", save, *extra,
    ]


def _same(actual, expected):
    """Both reported losses (``lm loss``, ``sop loss``) and the gradient norm of every step."""
    assert all(r.keys() == {"lm loss", "sop loss"} for r in expected.reported)
    assert_same_trajectory(actual, expected, steps=ITERS)


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    save = str(tmp_path_factory.mktemp("bert_ref") / "single")
    return run_script("pretrain_bert", _argv(data, save)), save


@pytest.mark.parametrize(
    "name, world, extra",
    [
        ("tp2_sp", 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
        ("pp2", 2, ["--pipeline-model-parallel-size", "2"]),
        ("dp2", 2, ["--use-distributed-optimizer"]),
        ("dp2_zero3", 2, ["--data-parallel-sharding-strategy", "optim_grads_params", "--overlap-grad-reduce",
                          "--overlap-param-gather"]),
        ("tp2_pp2_sp", 4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                           "--sequence-parallel"]),
    ],
)
def test_parallel_runs_reproduce_single_process(tmp_path, data, reference, name, world, extra):
    ref, ref_save = reference
    save = str(tmp_path / name)
    _same(ranks_trajectory(world, "pretrain_bert", _argv(data, save, extra=extra)), ref)
    a, _ = merge_checkpoint(save)
    b, saved = merge_checkpoint(ref_save)
    vocab = saved["vocab_size"]  # the padded tail depends on the TP size: compare the real rows
    assert_same_weights(a, b, saved, rows=dict.fromkeys(VOCAB_ROWS, vocab))
    assert ref.reported[-1]["lm loss"] < ref.reported[0]["lm loss"]  # it trained


def test_interleaved_pipeline_with_recompute_reproduces_single_process(tmp_path, data):
    """Also in Megatron-LM's original BERT residual order (--apply-residual-connection-post-layernorm)."""
    four = ["--num-layers", "4", "--apply-residual-connection-post-layernorm"]
    ref = run_script("pretrain_bert", _argv(data, str(tmp_path / "single4"), extra=four))
    extra = four + ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
                    "--recompute-granularity", "full", "--recompute-method", "uniform"]
    _same(ranks_trajectory(2, "pretrain_bert", _argv(data, str(tmp_path / "vpp"), extra=extra)), ref)


def test_no_binary_head_trains_without_sop_loss_on_document_level_data(tmp_path, data):
    """Without the binary head there are no sentence pairs: document-level data (refused with the head) trains."""
    save = str(tmp_path / "nohead")
    argv = _argv(data, save, extra=["--bert-no-binary-head"])
    argv[argv.index(data["sentence"])] = data["document"]
    reported = pretrain_bert.main(argv).reported
    assert all(r.keys() == {"lm loss"} for r in reported)
    assert reported[-1]["lm loss"] < reported[0]["lm loss"]
    model, saved = load_bert_checkpoint(save)
    assert saved["bert_no_binary_head"] and model.binary_head is None and model.embedding.tokentype_embeddings is None


def test_resume_continues_exactly(tmp_path, data, reference):
    save = str(tmp_path / "resumed")
    first = pretrain_bert.main(_argv(data, save, extra=["--exit-interval", "4"]))
    assert first.exit_reason == "interval" and first.iteration == 4
    second = pretrain_bert.main(_argv(data, save, extra=["--load", save]))
    assert second.iteration == ITERS
    assert_same_trajectory(Trajectory.of(first) + Trajectory.of(second), reference[0], rtol=0)  # bit-identical


def test_lora_fine_tunes_bert_and_tp2_sp_reproduces_one_process(tmp_path, data, reference):
    """LoRA on BERT from the reference checkpoint: the first step is the base model's (B = 0: a full
    fine-tune's first loss), TP2 + SP gives the one-process trajectory, and only adapters are saved."""
    lora = ["--pretrained-checkpoint", reference[1], "--lora-rank", "4", "--lora-alpha", "8"]
    single = run_script("pretrain_bert", _argv(data, str(tmp_path / "one"), extra=lora))
    full = run_script("pretrain_bert", _argv(data, str(tmp_path / "full"), extra=lora[:2]))
    assert full.reported[0] == single.reported[0] and full.losses[1:] != single.losses[1:]
    tp2 = ranks_trajectory(2, "pretrain_bert", _argv(data, str(tmp_path / "tp2"),
                                                     extra=lora + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]))
    _same(tp2, single)
    saved = merge_checkpoint(str(tmp_path / "one"))[0]
    assert saved and all(is_adapter_name(name) for name in saved), sorted(saved)[:5]


def test_fill_mask_reads_the_checkpoint(data, reference, capsys):
    capsys.readouterr()
    code = load_tool("fill_mask").main(["--load", reference[1], "--text", "the quick [MASK] fox", "--top-k", "3"])
    out = capsys.readouterr()
    assert code == 0, out.err
    lines = out.out.strip().splitlines()
    assert len(lines) == 2 and re.fullmatch(r"\[MASK\] at \d+: \S+ [01]\.\d{3}( \| \S+ [01]\.\d{3}){2}", lines[0]), lines
    assert lines[1].startswith("the quick ") and lines[1].endswith(" fox")


def test_a_bert_trained_with_megatrons_sentencepiece_tokenizer_fills_masks(tmp_path, data, capsys):
    """pretrain_bert.py trains with SentencePieceTokenizer (it appends [CLS]/[SEP]/[MASK]/[PAD] as Megatron's
    does); fill_mask refused such a checkpoint ('not a BERT WordPiece one') and had no --tokenizer-model."""
    _tool("tools/train_tokenizer.py", "--input", CORPUS, "--output-prefix", str(tmp_path / "sp"), "--model-type",
          "unigram", "--vocab-size", "500")
    tok = ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(tmp_path / "sp.model")]
    _tool("tools/preprocess_data.py", "--input", CORPUS, "--output-prefix", str(tmp_path / "sp"), "--split-sentences",
          *tok)
    save = str(tmp_path / "ck")
    run_script("pretrain_bert", _argv(data, save, iters=3, extra=["--data-path", str(tmp_path / "sp_text_sentence"),
                                                                  *tok]))
    assert load_tool("fill_mask").main(["--load", save, "--text", "the quick [MASK] fox", "--top-k", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()[-2:]
    # "the quick " is tokenized without a SentencePiece '▁' of its own after "quick": the mask follows [CLS] and it
    at = 1 + len(build_tokenizer("SentencePieceTokenizer", tokenizer_model=tok[-1]).tokenize("the quick"))
    assert re.fullmatch(rf"\[MASK\] at {at}: .+ [01]\.\d{{3}} \| .+ [01]\.\d{{3}}", lines[0]), lines
    assert lines[1].startswith("the quick") and lines[1].endswith("fox"), lines


@pytest.mark.parametrize("device, words", [("cuda", "this machine has 0 CUDA devices; use cpu"),
                                           ("cuda:1", "this machine has 0 CUDA devices"),
                                           ("tpu", "not a device name; use cpu or cuda"), ("mps", "use cpu or cuda")])
def test_fill_mask_device_it_cannot_use_is_one_line(tmp_path, capsys, monkeypatch, device, words):
    """Was a traceback (AssertionError 'Torch not compiled with CUDA enabled', RuntimeError 'Expected one of
    cpu, cuda, ...') after the checkpoint was loaded; now checked with the flags, before any loading."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as err:
        load_tool("fill_mask").main(["--load", str(tmp_path), "--text", "a [MASK]", "--device", device])
    assert err.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"--device {device}: {words}" in lines[0], lines


def _bad_vocab(data):
    path = data["dir"] / "no-cls-vocab.txt"
    words = [w for w in open(data["tok"][-1]).read().splitlines() if w != "[CLS]"]
    path.write_text("\n".join(words) + "\n")
    return str(path)


def _smaller_vocab(data):
    """The first 40 lines of the data's vocabulary: the data holds ids this one does not have."""
    path = data["dir"] / "smaller-vocab.txt"
    path.write_text("\n".join(open(data["tok"][-1]).read().splitlines()[:40]) + "\n")
    return str(path)


@pytest.mark.parametrize(
    "case, words",
    [
        ("document", ["document-level", "--split-sentences", "--bert-no-binary-head"]),
        ("valid_document", ["--valid-data-path", "document-level"]),  # every split's path is checked
        ("vocab", ["[CLS]"]),
        ("other_vocab", ["token id", "outside the tokenizer's vocabulary of 40", "another tokenizer"]),
        ("seq", ["--seq-length 4", "at least 5"]),
        ("bert_load", ["--bert-load", "--load"]),
        ("gpt_tokenizer", ["NullTokenizer", "BertWordPieceLowerCase", "or SentencePieceTokenizer --tokenizer-model"]),
        ("mtp", ["--mtp-num-layers", "GPT-only"]),
        # were 'give --data-path (or --mock-data for random tokens)', then '--mock-data ... need --vocab-size'
        ("no_data", ["needs a sentence-split --data-path", "--mock-data is GPT-only"]),
        ("mock", ["needs a sentence-split --data-path", "--mock-data is GPT-only"]),
    ],
)
def test_bad_input_is_one_line_exit_2(tmp_path, data, capsys, case, words):
    argv = _argv(data, str(tmp_path / "bad"), iters=4)
    if case == "document":
        argv += ["--data-path", data["document"]]
    elif case == "vocab":
        argv += ["--vocab-file", _bad_vocab(data)]
    elif case == "other_vocab":
        argv += ["--vocab-file", _smaller_vocab(data)]
    elif case == "seq":
        argv += ["--seq-length", "4"]
    elif case == "bert_load":
        argv += ["--bert-load", str(tmp_path)]
    elif case == "mtp":
        argv += ["--mtp-num-layers", "1", "--position-embedding-type", "rope"]
    elif case in ("no_data", "mock", "valid_document"):
        for flag in ("--data-path", "--split") if case == "valid_document" else ("--data-path",):
            i = argv.index(flag)  # --split does not apply to (and is refused with) per-split paths
            del argv[i : i + 2]
        argv += {"mock": ["--mock-data"], "no_data": [],
                 "valid_document": ["--train-data-path", data["sentence"], "--valid-data-path", data["document"]]}[case]
    else:
        argv += ["--tokenizer-type", "NullTokenizer", "--vocab-size", "50"]
    with pytest.raises(SystemExit) as err:
        pretrain_bert.main(argv)
    assert err.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    for w in words:
        assert w in lines[0], lines[0]


def test_loading_with_the_other_head_setting_names_the_flag(tmp_path, data, reference, capsys):
    argv = _argv(data, str(tmp_path / "other"), extra=["--load", reference[1], "--bert-no-binary-head"])
    with pytest.raises(SystemExit) as err:
        pretrain_bert.main(argv)
    assert err.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "no --bert-no-binary-head (this run: --bert-no-binary-head)" in lines[0], lines
    assert "; load it without --bert-no-binary-head" in lines[0], lines


def test_skip_train_evaluates_the_checkpoint_on_validation_and_test(tmp_path, data, reference, capsys):
    """--skip-train at the reference's checkpoint: one validation and one test pass (lm and sop losses),
    no step, nothing saved; --full-validation / --multiple-validation-sets are GPT-only (refused)."""
    _, save = reference
    before = sorted(os.listdir(save))
    argv = _argv(data, save, extra=["--load", save, "--skip-train"])
    argv[argv.index("--split") + 1], argv[argv.index("--eval-iters") + 1] = "60,30,10", "1"
    result = pretrain_bert.main(argv)
    assert result.losses == [] and result.iteration == ITERS and sorted(os.listdir(save)) == before
    assert [(it, name, sorted(v)) for it, name, v in result.evaluations] == [
        (ITERS, "validation", ["lm loss", "sop loss"]), (ITERS, "test", ["lm loss", "sop loss"])]
    # the same 8 samples in the same micro-batches of 2, read as 2 eval iterations of 4: the same passes
    halves = pretrain_bert.main(argv[:argv.index("--eval-iters")] + argv[argv.index("--eval-iters") + 2:]
                                + ["--eval-iters", "2", "--eval-global-batch-size", "4"])
    for (_, _, got), (_, _, expected) in zip(halves.evaluations, result.evaluations, strict=True):
        assert got == pytest.approx(expected, rel=1e-6)
    capsys.readouterr()
    refused_line(capsys, lambda: pretrain_bert.main(argv + ["--full-validation"]), "--full-validation",
                 "pretrain_gpt.py")
