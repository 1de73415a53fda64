"""--pretrained-checkpoint and --finetune: SFT from a pretrained checkpoint of any format and layout.

A base model is pretrained (mock tokens over the SFT tokenizer's 38 ids) and saved twice with
bit-identical weights, in the torch and the torch_dist format. Fine-tuning it with --sft must:
load exactly those weights at another layout and format (TP2 cut from the merged torch files,
PP2 from the torch_dist boxes and from each stage's own torch files), start at iteration 0 with a fresh optimizer and schedule (the same
trajectory as --finetune --load, unlike a resume), resume from --load once that holds a
checkpoint, and refuse a missing, empty or mismatched checkpoint in one line (exit 2).
"""

import shutil

import pytest
import torch

import pretrain_gpt
from megatron_lite.checkpoint import merge_checkpoint
from tests.e2e.test_convert_resume import _flags_printed
from tests.e2e.test_pretrain_gpt import _one_line_exit_2
from tests.e2e.test_sft import sft_argv, sft_files, sft_run_argv  # noqa: F401 (a module fixture)
from tests.harness import run_ranks
from tests.tools import load_tool
from tests.trajectory import Trajectory, assert_same_trajectory, ranks_trajectory, run_script

ITERS = 6


def base_argv(save, fmt):
    return ["--mock-data", "--vocab-size", "37", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
            "4", "--seq-length", "32", "--make-vocab-size-divisible-by", "16", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--train-iters", "4", "--lr", "1e-2", "--eval-iters", "0", "--log-interval",
            "1", "--attention-dropout", "0", "--hidden-dropout", "0", "--save", save, "--ckpt-format", fmt]


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("bases")
    out = {}
    for fmt in ("torch", "torch_dist"):
        out[fmt] = str(root / fmt)
        pretrain_gpt.main(base_argv(out[fmt], fmt))
    return out


@pytest.fixture(scope="module")
def reference(sft_files, bases):  # noqa: F811
    return run_script("pretrain_gpt", sft_argv(sft_files, extra=["--pretrained-checkpoint", bases["torch"]]))


def test_bases_are_the_same_weights_in_two_formats(bases):
    a, b = merge_checkpoint(bases["torch"])[0], merge_checkpoint(bases["torch_dist"])[0]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name, world, fmt, extra", [
    ("tp2_sp_from_torch", 2, "torch", ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    ("pp2_from_torch_dist", 2, "torch_dist", ["--pipeline-model-parallel-size", "2"]),
    # each stage reads and merges only its own layers' files (tests/unit/test_pretrained_rank_part.py)
    ("pp2_from_torch", 2, "torch", ["--pipeline-model-parallel-size", "2"]),
    ("dp2_distopt_from_torch_dist", 2, "torch_dist", ["--use-distributed-optimizer"]),
    ("dp2_zero3_from_torch", 2, "torch", ["--data-parallel-sharding-strategy", "optim_grads_params"]),
])
def test_pretrained_checkpoint_at_another_layout_and_format(sft_files, bases, reference, name, world, fmt, extra):  # noqa: F811
    argv = sft_argv(sft_files, extra=["--pretrained-checkpoint", bases[fmt]] + extra)
    got = ranks_trajectory(world, "pretrain_gpt", argv)
    assert_same_trajectory(got, reference, what=name)


def run_and_save(argv):
    """Inside a rank: train; this rank's final iteration and consumed samples."""
    result = pretrain_gpt.main(argv)
    return result.iteration, result.consumed_samples


def test_weights_are_loaded_exactly_and_the_run_starts_at_iteration_0(tmp_path, sft_files, bases):  # noqa: F811
    """lr 0 leaves the weights as loaded: the fine-tune's checkpoint (TP2, cut from the merged torch
    files) merges back to the base's weights bit for bit."""
    save = str(tmp_path / "ft")
    argv = sft_argv(sft_files, save=save, iters=2, extra=["--pretrained-checkpoint", bases["torch"], "--lr", "0",
                                                          "--tensor-model-parallel-size", "2"])
    assert set(run_ranks(2, run_and_save, argv)) == {(2, 16)}  # iterations 1, 2 from 0; samples from 0
    got, base = merge_checkpoint(save)[0], merge_checkpoint(bases["torch"])[0]
    assert got.keys() == base.keys()
    for key in base:  # the vocabulary is padded to 48 rows at TP 1, 64 at TP 2: the 38 real rows are the same
        mine, theirs = (got[key][:38], base[key][:38]) if key.startswith("embedding.word") else (got[key], base[key])
        assert torch.equal(mine, theirs), key


def test_weights_load_at_the_same_layout_with_another_vocabulary_padding(tmp_path, sft_files, bases):  # noqa: F811
    """A torch base at this run's layout but another --make-vocab-size-divisible-by (48 padded rows,
    64 here) was refused ("embedding.word_embeddings.weight is (48, 32) in the checkpoint, (64, 32)
    here"), though the same base loads at another TP size and from torch_dist re-padded. It loads
    re-padded now: lr 0, the 38 real rows and every other weight as saved, bit for bit."""
    save = str(tmp_path / "ft")
    result = pretrain_gpt.main(sft_argv(sft_files, save=save, iters=1, extra=[
        "--pretrained-checkpoint", bases["torch"], "--lr", "0", "--make-vocab-size-divisible-by", "64"]))
    assert result.iteration == 1
    got, base = merge_checkpoint(save)[0], merge_checkpoint(bases["torch"])[0]
    assert got["embedding.word_embeddings.weight"].shape[0] == 64 and base["embedding.word_embeddings.weight"].shape[0] == 48
    for key in base:
        mine, theirs = (got[key][:38], base[key][:38]) if key.startswith("embedding.word") else (got[key], base[key])
        assert torch.equal(mine, theirs), key


def test_finetune_flag_is_the_same_start_and_differs_from_a_resume(sft_files, bases, reference):  # noqa: F811
    finetune = run_script("pretrain_gpt", sft_argv(sft_files, extra=["--load", bases["torch_dist"], "--finetune"]))
    assert_same_trajectory(finetune, reference, what="--finetune --load")
    resume = pretrain_gpt.main(sft_argv(sft_files, extra=["--load", bases["torch"], "--train-iters", "10",
                                                          "--override-opt_param-scheduler"]))
    assert len(resume.losses) == ITERS  # iterations 5..10: the base's iteration 4 and optimizer carried on
    assert Trajectory.of(resume).grad_norms[0] != pytest.approx(reference.grad_norms[0], rel=1e-3)


def test_restart_resumes_from_load_not_the_pretrained_checkpoint(tmp_path, capsys, sft_files, bases, reference):  # noqa: F811
    """The same command twice: the first run loads the pretrained weights and stops at iteration 3,
    the second resumes from --load (the pretrained checkpoint is not read again) and finishes."""
    run = str(tmp_path / "run")
    base = str(tmp_path / "base")
    shutil.copytree(bases["torch"], base)
    argv = sft_argv(sft_files, save=run, extra=["--load", run, "--pretrained-checkpoint", base, "--exit-interval", "3"])
    first = run_script("pretrain_gpt", argv)
    shutil.rmtree(base)  # a second read of it would fail
    capsys.readouterr()
    second = run_script("pretrain_gpt", argv[:-2])
    assert "loading checkpoint from " + run in capsys.readouterr().out
    assert_same_trajectory(first + second, reference, what="restart")


def test_sft_from_an_imported_hugging_face_model(tmp_path, capsys, sft_files):  # noqa: F811
    """A Llama-style model imported with the converter is fine-tuned with --sft from
    --pretrained-checkpoint (the converter's model flags): TP2 + SP reproduces one process."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=38, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False))
    hf.save_pretrained(str(tmp_path / "hf"))
    capsys.readouterr()
    assert load_tool("checkpoint/convert").main(["--model-type", "GPT", "--loader", "hf", "--load-dir",
                                                 str(tmp_path / "hf"), "--save-dir", str(tmp_path / "mg")]) == 0
    flags = _flags_printed(capsys)
    assert flags[:2] == ["--load", str(tmp_path / "mg")]
    argv = ["--pretrained-checkpoint"] + flags[1:] + sft_run_argv(sft_files) + ["--lr", "1e-3"]
    single = run_script("pretrain_gpt", argv)
    tp2 = ranks_trajectory(2, "pretrain_gpt", argv + ["--tensor-model-parallel-size", "2", "--sequence-parallel"])
    assert_same_trajectory(tp2, single, what="tp2 from an HF import")
    assert single.losses[-1] < single.losses[0]


@pytest.mark.parametrize("which, words", [
    ("missing", ["--pretrained-checkpoint", "it does not exist", "convert.py"]),
    ("empty", ["--pretrained-checkpoint", "it holds no checkpoint"]),
    ("mismatch", ["was saved with --hidden-size 32 (this run 64)", "; load it with --hidden-size 32 "]),
])
def test_bad_pretrained_checkpoint_is_one_line(tmp_path, capsys, sft_files, bases, which, words):  # noqa: F811
    path = {"missing": str(tmp_path / "nothing"), "empty": str(tmp_path), "mismatch": bases["torch"]}[which]
    extra = ["--pretrained-checkpoint", path] + (["--hidden-size", "64"] if which == "mismatch" else [])
    _one_line_exit_2(capsys, sft_argv(sft_files, iters=1, extra=extra), *words)


@pytest.mark.parametrize("which, words", [
    ("no_load", ["--finetune needs --load"]),
    ("missing", ["--finetune --load", "the folder does not exist", "no weights to start from"]),
    ("empty", ["--finetune --load", "it holds no checkpoint", "no weights to start from"]),
])
def test_finetune_without_a_checkpoint_is_one_line_not_a_run_from_scratch(tmp_path, capsys, sft_files, which,  # noqa: F811
                                                                          words):
    load = {"no_load": [], "missing": ["--load", str(tmp_path / "nothing")], "empty": ["--load", str(tmp_path)]}
    _one_line_exit_2(capsys, sft_argv(sft_files, iters=1, extra=["--finetune"] + load[which]), *words)


def run_cli(argv):
    return pretrain_gpt.main(argv).iteration


@pytest.mark.parametrize("grouped", [False, True], ids=["sequential", "grouped"])
def test_expert_weights_load_at_another_expert_parallel_size(tmp_path, grouped):
    """A torch-format MoE checkpoint saved at EP2 loads at EP1 x TP2 (+ SP): with lr 0 the
    fine-tune's checkpoint merges back to the base's weights bit for bit, experts included."""
    from tests.e2e.test_pretrain_gpt import _argv
    from tests.e2e.test_pretrain_moe import MOE

    model = MOE + (["--moe-grouped-gemm"] if grouped else [])
    base, ft = str(tmp_path / "base"), str(tmp_path / "ft")
    assert run_ranks(2, run_cli, _argv(base, 3, model + ["--expert-model-parallel-size", "2"])) == [3, 3]
    argv = _argv(ft, 1, model + ["--lr-warmup-iters", "0", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                                 "--pretrained-checkpoint", base, "--lr", "0"])
    assert run_ranks(2, run_cli, argv) == [1, 1]
    got, want = merge_checkpoint(ft)[0], merge_checkpoint(base)[0]
    assert got.keys() == want.keys() and any(".experts." in k for k in want)
    assert all(torch.equal(got[k], want[k]) for k in want)
