"""pretrain_gpt.py through its command line: parallel runs reproduce the single-process run.

Each parallel run calls ``pretrain_gpt.main(argv)`` on every rank of a reused gloo pool (the same
code path as ``torchrun``, minus process start-up); the reference is ``main(argv)`` in this
process. Same seed, same global batch, dropout 0, fp32: every step's loss and gradient norm must
agree within a relative 1e-5 (:func:`tests.trajectory.assert_same_trajectory`), and the final
weights, merged from the saved checkpoints, as :func:`assert_same_weights` says.
"""

import os

import pytest
import torch

import pretrain_gpt
from megatron_lite.checkpoint import merge_checkpoint
from tests.trajectory import Trajectory, assert_same_trajectory, ranks_trajectory, run_script

MODEL = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--vocab-size", "123", "--make-vocab-size-divisible-by", "8", "--mock-data",
    "--attention-dropout", "0", "--hidden-dropout", "0", "--lr", "1e-2", "--lr-warmup-iters", "2",
    "--weight-decay", "0.1", "--clip-grad", "1.0", "--log-interval", "1", "--eval-iters", "0", "--seed", "7",
]
# rope + RMSNorm + SwiGLU + GQA + untied: the other branch of every model option.
MODEL_B = [
    "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
    "--untie-embeddings-and-output-weights", "--group-query-attention", "--num-query-groups", "2",
]


def _argv(save, iters, extra):
    return MODEL + ["--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(iters),
                    "--save", save] + list(extra)


def _single(tmp_path, name, iters, extra=()):
    """Train in this process; (trajectory, save folder)."""
    save = str(tmp_path / name)
    return run_script("pretrain_gpt", _argv(save, iters, extra)), save


def _parallel(tmp_path, name, world, iters, extra):
    """Train on ``world`` ranks; (the last-stage trajectory, save folder)."""
    save = str(tmp_path / name)
    return ranks_trajectory(world, "pretrain_gpt", _argv(save, iters, extra)), save


def _one_line_exit_2(capsys, argv, *words):
    """``pretrain_gpt.main(argv)`` must exit 2 with one stderr line containing every word."""
    with pytest.raises(SystemExit) as err:
        pretrain_gpt.main(argv)
    assert err.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    for w in words:
        assert w in lines[0], lines[0]


def key_bias_entries(name: str, tensor: torch.Tensor, saved: dict) -> torch.Tensor | None:
    """The mask of the key part of a QKV bias (``None`` for any other tensor).

    Its gradient is zero in exact arithmetic (a bias on every key shifts all scores of a query
    equally), so Adam normalises pure rounding noise into updates of random sign: those entries
    agree only to ~1e-5 absolute, whatever the parallel layout.
    """
    if not name.endswith("self_attention.linear_qkv.bias"):
        return None
    heads = saved["num_attention_heads"]
    groups = saved.get("num_query_groups") or heads
    mask = torch.zeros(groups, heads // groups + 2, tensor.numel() // (heads + 2 * groups), dtype=torch.bool)
    mask[:, heads // groups] = True  # per query group: its query heads, its key head, its value head
    return mask.view(-1)


# rtol 1e-5 with a floor for entries near zero: over every e2e comparison (2500 tensors) the largest
# excess over rtol 1e-5 was 3.8e-7. The key part of a QKV bias differs by up to 1.4e-5.
WEIGHT_RTOL, WEIGHT_ATOL = 1e-5, 2e-6
KEY_BIAS_ATOL = 1e-4


def assert_same_weights(a: dict, b: dict, saved: dict, rows: dict | None = None) -> None:
    """Every tensor of ``a`` equal to ``b``'s within rtol WEIGHT_RTOL (atol WEIGHT_ATOL); the key
    part of a QKV bias (:func:`key_bias_entries`), and only it, within KEY_BIAS_ATOL absolute.
    ``rows``: ``{name: n}`` compares only the first n rows of those tensors (padded vocabularies)."""
    assert a.keys() == b.keys()
    for k in a:
        x, y = (a[k][: rows[k]], b[k][: rows[k]]) if rows and k in rows else (a[k], b[k])
        key = key_bias_entries(k, y, saved)
        if key is not None:
            torch.testing.assert_close(x[key], y[key], rtol=WEIGHT_RTOL, atol=KEY_BIAS_ATOL,
                                       msg=lambda m, k=k: f"{k} (key part): {m}")
            x, y = x[~key], y[~key]
        torch.testing.assert_close(x, y, rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL, msg=lambda m, k=k: f"{k}: {m}")


def _same_weights(save_a, save_b):
    """The final weights merged from two save folders: :func:`assert_same_weights`."""
    a, saved = merge_checkpoint(save_a)
    b, _ = merge_checkpoint(save_b)
    assert_same_weights(a, b, saved)


ITERS = 5  # past the 2 warm-up steps; both references' 5th loss is below their first (A 4.7912 < 4.8303, B 4.8044 < 4.8374)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    return {variant: _single(tmp, f"single{variant}", ITERS, extra) for variant, extra in (("A", []), ("B", MODEL_B))}


@pytest.mark.parametrize(
    "name, world, variant, extra",
    [
        ("tp2", 2, "A", ["--tensor-model-parallel-size", "2"]),
        ("tp2_sp", 2, "B", ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
        ("dp2", 2, "A", ["--overlap-grad-reduce", "--ddp-bucket-size", "4000"]),
        ("tp2_dp2_sp", 4, "B", ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
        ("dp4_distopt", 4, "B", ["--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-bucket-size", "3000"]),
        ("pp2", 2, "A", ["--pipeline-model-parallel-size", "2"]),
        ("pp4", 4, "B", ["--pipeline-model-parallel-size", "4"]),
        ("pp2_vpp2", 2, "A", ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]),
        ("pp2_first1", 2, "B", ["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "1"]),
        ("tp2_pp2_sp", 4, "B", ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                "--sequence-parallel"]),
        ("tp2_pp2_dp2", 8, "A", ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                 "--num-layers-per-virtual-pipeline-stage", "1", "--sequence-parallel"]),
    ],
)
def test_parallel_runs_reproduce_single_process(tmp_path, reference, name, world, variant, extra):
    ref, ref_save = reference[variant]
    got, save = _parallel(tmp_path, name, world, ITERS, (MODEL_B if variant == "B" else []) + extra)
    assert_same_trajectory(got, ref, steps=ITERS)
    _same_weights(save, ref_save)
    assert ref.losses[-1] < ref.losses[0]  # it trained


def test_recompute_gives_the_same_losses(tmp_path):
    # Dropout on: recomputation must replay the masks exactly.
    drop = ["--attention-dropout", "0.1", "--hidden-dropout", "0.1"]
    base, _ = _single(tmp_path, "none", 4, drop)
    full, _ = _single(tmp_path, "full", 4, drop + ["--recompute-granularity", "full", "--recompute-method", "uniform"])
    block, _ = _single(tmp_path, "block", 4, drop + ["--recompute-granularity", "full", "--recompute-method", "block",
                                                     "--recompute-num-layers", "2"])
    sel, _ = _single(tmp_path, "sel", 4, drop + ["--recompute-granularity", "selective"])
    for what, other in (("full", full), ("block", block), ("selective", sel)):
        assert_same_trajectory(other, base, steps=4, what=what)


def test_resume_continues_exactly(tmp_path, capsys):
    straight, _ = _single(tmp_path, "straight", 12)
    save = str(tmp_path / "resumed")
    first = pretrain_gpt.main(_argv(save, 12, ["--exit-interval", "6"]))
    assert first.exit_reason == "interval" and first.iteration == 6
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == "6"
    capsys.readouterr()
    second = pretrain_gpt.main(_argv(save, 12, ["--load", save]))
    assert second.iteration == 12
    log = capsys.readouterr().out
    assert "iteration        7/      12 | consumed samples:           56 |" in log  # counted from the checkpoint
    assert_same_trajectory(Trajectory.of(first) + Trajectory.of(second), straight, rtol=0)  # bit-identical


def _real_data(sample_dataset):
    """MODEL's flags with the sample corpus instead of --mock-data (random tokens cannot be learned)."""
    model = [a for a in MODEL if a != "--mock-data"]
    i = model.index("--vocab-size")
    del model[i : i + 2]
    return model + ["--data-path", sample_dataset["prefix"], "--split", "95,5,0"] + sample_dataset["tokenizer"]


def test_trains_on_preprocessed_data_in_bf16(tmp_path, sample_dataset):
    argv = _real_data(sample_dataset) + ["--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", "30",
                                         "--bf16", "--eval-interval", "30", "--eval-iters", "2",
                                         "--data-cache-path", str(tmp_path / "cache")]
    result = pretrain_gpt.main(argv)
    losses = result.losses
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses
    assert result.validation and result.validation[-1][1] < losses[0]


def test_corrupt_data_file_is_one_line_exit_2(tmp_path, sample_dataset, capsys):
    bad = tmp_path / "bad_text_document"
    (tmp_path / "bad_text_document.idx").write_bytes(open(sample_dataset["prefix"] + ".idx", "rb").read()[:40])
    (tmp_path / "bad_text_document.bin").write_bytes(open(sample_dataset["prefix"] + ".bin", "rb").read())
    argv = _real_data(sample_dataset) + ["--data-path", str(bad), "--train-iters", "4"]
    _one_line_exit_2(capsys, argv, "bad_text_document.idx")


@pytest.mark.parametrize(
    "flags, world, words",
    [
        (["--num-attention-heads", "6", "--hidden-size", "36", "--tensor-model-parallel-size", "4"], 4,
         ["num-attention-heads 6", "tensor-model-parallel-size 4"]),
        # a shape no launch can run is said before the world size (4 heads do not split over 3)
        (["--tensor-model-parallel-size", "3"], 4, ["num-attention-heads 4", "tensor-model-parallel-size 3"]),
        (["--context-parallel-size", "8"], 4, ["world size 4", "context-parallel-size 8"]),
        (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
          "--global-batch-size", "2"], 2, ["--global-batch-size", "multiple of --pipeline-model-parallel-size 2"]),
        (["--pipeline-model-parallel-size", "3"], 3, ["num-layers 4", "pipeline-model-parallel-size 3"]),
        (["--bf16", "--fp16"], 1, ["--bf16 and --fp16"]),
        (["--log-interval", "0"], 1, ["--log-interval must be at least 1"]),
        (["--make-vocab-size-divisible-by", "0"], 1, ["--make-vocab-size-divisible-by"]),
        (["--fp16", "--hysteresis", "0"], 1, ["--hysteresis must be at least 1"]),
        (["--fp16", "--loss-scale", "-1"], 1, ["--loss-scale must be positive"]),
        (["--fp16", "--initial-loss-scale", "8", "--min-loss-scale", "16"], 1,
         ["--min-loss-scale 16.0 is larger than --initial-loss-scale 8.0"]),
        (["--adam-beta1", "1.5"], 1, ["--adam-beta1 must be in [0, 1)"]),
        (["--adam-beta2", "1"], 1, ["--adam-beta2 must be in [0, 1)"]),
        (["--adam-eps=-1e-8"], 1, ["--adam-eps must be positive"]),
        (["--weight-decay", "-0.1"], 1, ["--weight-decay must be at least 0"]),
        (["--optimizer", "sgd", "--weight-decay", "-0.1"], 1, ["--weight-decay must be at least 0"]),
        (["--ddp-bucket-size", "0"], 1, ["--ddp-bucket-size"]),
        (["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "100", "--train-iters", "10"], 1, ["--lr-wsd-decay-iters"]),
        (["--decoder-first-pipeline-num-layers", "1"], 1, ["--decoder-first-pipeline-num-layers"]),
        (["--fp8-format", "e4m3"], 1, ["--fp8-format e4m3 needs --bf16"]),
        (["--overlap-param-gather", "--use-distributed-optimizer"], 1, ["--overlap-param-gather needs --overlap-grad-reduce"]),
        (["--expert-model-parallel-size", "2"], 2, ["mixture-of-experts"]),
    ],
)
def test_bad_flags_exit_2_with_one_line(capsys, monkeypatch, flags, world, words):
    monkeypatch.setenv("WORLD_SIZE", str(world))  # validated before any process group is made
    _one_line_exit_2(capsys, MODEL + ["--micro-batch-size", "2"] + flags, *words)


def test_exit_duration_saves_and_stops(tmp_path):
    save = str(tmp_path / "dur")
    result = pretrain_gpt.main(_argv(save, 50, ["--exit-duration-in-mins", "1e-9"]))  # 60 ns: after iteration 1
    assert result.exit_reason == "duration" and result.iteration == 1
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read().strip() == "1"


def test_exit_duration_zero_is_no_limit(tmp_path, capsys):
    """As in Megatron-LM, --exit-duration-in-mins 0 sets no limit (it stopped the run after iteration 1);
    a negative value is refused in one line."""
    result = pretrain_gpt.main(_argv(str(tmp_path / "zero"), 3, ["--exit-duration-in-mins", "0"]))
    assert result.exit_reason == "done" and result.iteration == 3
    _one_line_exit_2(capsys, _argv(str(tmp_path / "neg"), 3, ["--exit-duration-in-mins", "-1"]),
                     "--exit-duration-in-mins must not be negative", "0 or unset: no limit")


def test_checkpoint_of_another_pipeline_layout_is_refused(tmp_path, capsys):
    save = str(tmp_path / "pp2")
    ranks_trajectory(2, "pretrain_gpt", _argv(save, 3, ["--pipeline-model-parallel-size", "2"]))
    _one_line_exit_2(capsys, _argv(str(tmp_path / "other"), 4, ["--load", save]), "pipeline-model-parallel-size 2")


def test_resume_with_distributed_optimizer_and_tp_continues_exactly(tmp_path):
    extra = ["--use-distributed-optimizer", "--tensor-model-parallel-size", "2", "--bf16"]
    straight, _ = _parallel(tmp_path, "straight", 4, 6, extra)
    save = str(tmp_path / "resumed")
    first = ranks_trajectory(4, "pretrain_gpt", _argv(save, 6, extra + ["--exit-interval", "3"]))
    second = ranks_trajectory(4, "pretrain_gpt", _argv(save, 6, extra + ["--load", save]))
    assert_same_trajectory(first + second, straight, rtol=0)


def test_default_split_and_cyclic_order_on_a_small_corpus(tmp_path, sample_dataset):
    # 461 documents: --split 969,30,1 leaves the test split empty, which must not matter
    argv = _real_data(sample_dataset)
    i = argv.index("--split")
    del argv[i : i + 2]
    argv += ["--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "4", "--dataloader-type", "cyclic",
             "--eval-interval", "4", "--eval-iters", "1", "--data-cache-path", str(tmp_path / "cache")]
    result = pretrain_gpt.main(argv)
    assert result.iteration == 4 and len(result.validation) == 1


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"], ["token id", "outside the tokenizer's vocabulary of 101"]),
        (["--eod-mask-loss", "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", "VOCAB"],
         ["--eod-mask-loss need an end-of-document token"]),
    ],
)
def test_data_that_does_not_fit_the_tokenizer_is_one_line(tmp_path, sample_dataset, capsys, flags, words):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b"]) + "\n")
    argv = _real_data(sample_dataset) + ["--train-iters", "4", "--data-cache-path", str(tmp_path / "c")]
    argv += [str(vocab) if f == "VOCAB" else f for f in flags]
    _one_line_exit_2(capsys, argv, *words)


def test_a_token_id_only_in_the_labels_is_refused_too(tmp_path, capsys):
    """One sample of 16 inputs whose 17th token (a label, never an input) is outside the vocabulary: the
    labels are checked as well as the inputs (the loss silently skipped that target)."""
    from megatron_lite.data.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "labels_text_document")
    with IndexedDatasetBuilder(prefix, "uint16") as builder:
        builder.add_document(list(range(1, 17)) + [150], [17])
    model = [a for a in MODEL if a != "--mock-data"]
    i = model.index("--vocab-size")
    del model[i : i + 2]
    argv = model + ["--data-path", prefix, "--split", "100,0,0", "--tokenizer-type", "NullTokenizer", "--vocab-size",
                    "100", "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1",
                    "--lr-warmup-iters", "0", "--data-cache-path", str(tmp_path / "c")]
    _one_line_exit_2(capsys, argv, "token id 150", "outside the tokenizer's vocabulary of 101")


def test_distributed_optimizer_checkpoint_resumes_at_another_data_parallel_size(tmp_path):
    extra = ["--use-distributed-optimizer"]
    straight, _ = _single(tmp_path, "straight", 8, extra)
    save = str(tmp_path / "dp2")
    first = ranks_trajectory(2, "pretrain_gpt", _argv(save, 8, extra + ["--exit-interval", "4"]))
    second = run_script("pretrain_gpt", _argv(save, 8, extra + ["--load", save]))  # one process, DP 1
    assert_same_trajectory(first + second, straight, steps=8)
