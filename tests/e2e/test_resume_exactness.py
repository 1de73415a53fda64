"""Stopped at step k and resumed, a run's steps k+1.. are the uninterrupted run's, bit for bit (fp32
on CPU: losses, every reported loss and gradient norms compared with ``==``), for the combinations
users resume most that no other test resumes: per-split data paths (--train-data-path /
--valid-data-path / --test-data-path, validation included), the WSD and inverse-square-root
learning-rate schedules (the stop inside the decay), a stop by --exit-duration-in-mins, multi-token
prediction with tied embeddings at PP2 (the last stage's embedding copy feeds the MTP depths), MLA
at TP2 from torch_dist, delayed-scaling FP8 at TP2 + SP from torch_dist (the amax histories resume)
and LoRA with adapter dropout (its random stream resumes). Some resumes cannot be bit for bit, by
design, and say so in one start-up line (megatron_lite/checkpoint/resume_notes.py): at another
layout (here MLA's TP2 checkpoint in one process) or another --micro-batch-size, which follow within
rounding (rel 1e-5), and under --transformer-impl transformer_engine with delayed FP8 scaling (TE's
scaling state is not saved). --exit-duration-in-mins counts the start-up and checkpoint load."""

import os
import shutil
import time

import pytest

import pretrain_gpt
from tests import fake_transformer_engine as fake_te
from tests.e2e.test_lora import COMMON as LORA_COMMON
from tests.e2e.test_lora import LORA
from tests.e2e.test_pretrain_deepseek import VARIANTS
from tests.e2e.test_pretrain_gpt import _argv, _one_line_exit_2
from tests.trajectory import Trajectory, assert_same_trajectory, ranks_trajectories
from tests.unit.test_data_builder import write

ITERS, STOP = 6, 3


def _stop_and_resume(tmp_path, argv_of, stop=("--exit-interval", str(STOP))):
    """(uninterrupted, stopped, resumed) results of one-process runs; ``argv_of(save)`` gives the flags."""
    full = pretrain_gpt.main(argv_of(str(tmp_path / "full")))
    part = str(tmp_path / "part")
    first = pretrain_gpt.main(argv_of(part) + list(stop))
    shutil.copytree(part, part + "_stop")  # the checkpoint at the stop, before the resume saves its last step
    second = pretrain_gpt.main(argv_of(part) + ["--load", part])
    return full, first, second


def _assert_continues(full, first, second):
    assert Trajectory.of(first) + Trajectory.of(second) == Trajectory.of(full)
    assert first.validation + second.validation == full.validation


def test_per_split_data_paths(tmp_path):
    """A train blend, a valid and a test dataset of their own; validation at 2, 4 and 6."""
    a, b, c = (write(tmp_path / n, d, seed=s) for n, d, s in (("a", 80, 1), ("b", 60, 2), ("c", 60, 3)))
    data = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "500", "--lr", "1e-2", "--eval-interval", "2", "--eval-iters", "2", "--seed", "3",
            "--log-interval", "1", "--train-iters", str(ITERS), "--data-cache-path", str(tmp_path / "cache"),
            "--train-data-path", "0.4", a, "0.6", b, "--valid-data-path", c, "--test-data-path", b]
    full, first, second = _stop_and_resume(tmp_path, lambda save: data + ["--save", save])
    assert [i for i, _ in full.validation] == [2, 4, 6]
    _assert_continues(full, first, second)


@pytest.mark.parametrize("schedule", [
    ["--lr-decay-style", "WSD", "--lr-wsd-decay-style", "minus_sqrt", "--lr-wsd-decay-iters", "4", "--min-lr", "1e-3"],
    ["--lr-decay-style", "inverse-square-root", "--min-lr", "1e-4"],
], ids=["wsd_minus_sqrt", "inverse_square_root"])
def test_learning_rate_schedules(tmp_path, schedule):
    """Stopped inside WSD's decay (it starts after step 2) or past inverse-square-root's warmup."""
    full, first, second = _stop_and_resume(tmp_path, lambda save: _argv(save, ITERS, schedule))
    _assert_continues(full, first, second)
    assert second.optimizer.param_groups[0]["lr"] == full.optimizer.param_groups[0]["lr"]


def test_a_stop_by_exit_duration(tmp_path):
    """--exit-duration-in-mins (here: past at once) saves after the step and stops; the resume continues."""
    full, first, second = _stop_and_resume(tmp_path, lambda save: _argv(save, ITERS, []),
                                           stop=("--exit-duration-in-mins", "1e-9"))
    assert (first.exit_reason, first.iteration) == ("duration", 1)
    _assert_continues(full, first, second)


def test_exit_duration_counts_the_start_up_and_checkpoint_load(tmp_path, monkeypatch):
    """--exit-duration-in-mins is the signal-free way to save before a scheduler's time limit, which
    counts from the job's start (Megatron-LM counts from its start too). The minutes were counted from
    the first step, so a resume whose checkpoint load took 10 minutes ran 10 minutes past the limit (and
    was killed before saving). Here the load "takes" 10 minutes of a 5-minute limit: the run saves and
    stops after its first step."""
    from types import SimpleNamespace

    from megatron_lite.training import loop

    save = str(tmp_path / "ckpt")
    pretrain_gpt.main(_argv(save, ITERS, ["--exit-interval", "1"]))
    skipped = [0.0]
    monkeypatch.setattr(loop, "time", SimpleNamespace(time=lambda: time.time() + skipped[0]))
    real_build = loop.build_run

    def slow_build(*args, **kwargs):
        built = real_build(*args, **kwargs)
        skipped[0] += 600.0  # ten minutes of start-up: the model built and the checkpoint loaded
        return built

    monkeypatch.setattr(loop, "build_run", slow_build)
    run = pretrain_gpt.main(_argv(save, ITERS, ["--load", save, "--exit-duration-in-mins", "5"]))
    assert (run.exit_reason, run.iteration) == ("duration", 2)


NON_PERSISTENT = ["--ckpt-format", "torch_dist", "--async-save", "--save-interval", "2",
                  "--non-persistent-save-interval", "1", "--non-persistent-ckpt-type", "global"]


def test_a_non_persistent_checkpoint_newer_than_the_persistent_one_resumes_exactly(tmp_path, capsys):
    """A run killed after the non-persistent save of step 3 (its persistent checkpoint: step 2) resumes
    from <save>/non_persistent, bit for bit (torch_dist, --async-save). Only the latest non-persistent
    checkpoint is kept, and, resumed with --save-retain-interval 4, of the persistent ones the multiples
    of 4 and the latest; the resume skips the weights' initialisation (--no-initialization). A missing
    --ckpt-step, --exit-on-missing-checkpoint and --no-initialization without a checkpoint exit 2 in one line."""
    full = pretrain_gpt.main(_argv(str(tmp_path / "full"), ITERS, NON_PERSISTENT))
    part = str(tmp_path / "part")
    first = pretrain_gpt.main(_argv(part, ITERS, NON_PERSISTENT + ["--exit-interval", str(STOP)]))
    shutil.rmtree(f"{part}/iter_0000003")  # as if killed after step 3: no persistent save of it
    with open(f"{part}/latest_checkpointed_iteration.txt", "w") as f:
        f.write("2\n")
    assert sorted(os.listdir(f"{part}/non_persistent")) == ["iter_0000003", "latest_checkpointed_iteration.txt"]
    second = pretrain_gpt.main(_argv(part, ITERS, NON_PERSISTENT + ["--load", part, "--save-retain-interval", "4",
                                                                    "--no-initialization"]))
    _assert_continues(full, first, second)
    assert sorted(os.listdir(part)) == ["iter_0000004", "iter_0000006", "latest_checkpointed_iteration.txt",
                                        "non_persistent"]
    assert sorted(os.listdir(f"{part}/non_persistent")) == ["iter_0000005", "latest_checkpointed_iteration.txt"]
    capsys.readouterr()
    _one_line_exit_2(capsys, _argv(part, ITERS, ["--load", part, "--ckpt-step", "3"]),
                     f"--ckpt-step 3: --load {part} has no checkpoint", "(iterations held: 4, 6)")
    _one_line_exit_2(capsys, _argv(part, ITERS, ["--load", str(tmp_path / "none"), "--exit-on-missing-checkpoint"]),
                     "--exit-on-missing-checkpoint: no checkpoint at --load")
    _one_line_exit_2(capsys, _argv(part, ITERS, ["--load", str(tmp_path / "none"), "--no-initialization"]),
                     "--no-initialization skips drawing the initial weights, but --load")


# 4 steps stopped at 2 (the 2 warm-up steps, then 2 resumed); FP8's amax history of 2 is full at the stop,
# so the resumed steps roll the restored history, and with ``max`` its older row sets the scales (with
# ``most_recent``, the default, only the latest row does: a history not restored would go unnoticed)
TWO_ITERS, TWO_STOP = 4, 2
TWO_RANKS = {  # name: the flags of a 2-rank run
    "mtp_tied_embeddings_pp2": VARIANTS["noq"] + ["--pipeline-model-parallel-size", "2"],
    "mla_tp2_torch_dist": VARIANTS["noq"] + ["--tensor-model-parallel-size", "2", "--ckpt-format", "torch_dist"],
    "fp8_delayed_tp2_sp_torch_dist": ["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "delayed",
                                      "--fp8-amax-history-len", "2", "--fp8-amax-compute-algo", "max",
                                      "--tensor-model-parallel-size", "2",
                                      "--sequence-parallel", "--ckpt-format", "torch_dist"],
}


@pytest.mark.parametrize("name", list(TWO_RANKS))
def test_two_rank_layouts(tmp_path, capsys, name):
    """The uninterrupted and the stopped run in one pool call, then the resume. MLA's TP2 checkpoint
    also resumes in one process: not bit for bit, by design (:mod:`megatron_lite.checkpoint.resume_notes`)."""
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    flags = TWO_RANKS[name]
    whole, first = ranks_trajectories(2, "pretrain_gpt", [_argv(full, TWO_ITERS, flags),
                                                          _argv(part, TWO_ITERS, flags + ["--exit-interval", str(TWO_STOP)])])
    shutil.copytree(part, part + "_stop")  # the checkpoint at TWO_STOP, before the resume saves the last step
    [second] = ranks_trajectories(2, "pretrain_gpt", [_argv(part, TWO_ITERS, flags + ["--load", part])])
    assert len(first) == TWO_STOP and first + second == whole
    if name == "mla_tp2_torch_dist":  # at another layout: the same run within rounding, and one line says so
        capsys.readouterr()
        one = pretrain_gpt.main(_argv(str(tmp_path / "tp1"), TWO_ITERS, VARIANTS["noq"] + [
            "--ckpt-format", "torch_dist", "--load", part + "_stop", "--no-load-rng"]))
        notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("> note: the checkpoint")]
        assert notes == ["> note: the checkpoint was saved at TP2 (2 ranks), micro-batch size 2, this run is TP1 "
                         "(1 ranks), micro-batch size 2: it continues the saved run within floating-point rounding, "
                         "not bit for bit (sums in another order; with dropout, other masks)"]
        assert_same_trajectory(first + Trajectory.of(one), whole, what="TP2 -> TP1")


def test_another_micro_batch_size_follows_within_rounding_and_says_so(tmp_path, capsys):
    """The same global batch of 8 in micro-batches of 4 instead of 2 (e.g. after an out-of-memory): the
    gradient is summed in other pieces, so the resume follows within rounding, and says so once."""
    full, first, _ = _stop_and_resume(tmp_path, lambda save: _argv(save, ITERS, []))
    assert "> note: the checkpoint was saved" not in capsys.readouterr().out  # the same layout: bit for bit
    argv = _argv(str(tmp_path / "part"), ITERS, ["--load", str(tmp_path / "part_stop")])
    argv[argv.index("--micro-batch-size") + 1] = "4"
    other = pretrain_gpt.main(argv)
    assert capsys.readouterr().out.count("micro-batch size 2, this run is TP1 (1 ranks), micro-batch size 4: it "
                                         "continues the saved run within floating-point rounding") == 1
    assert_same_trajectory(Trajectory.of(first) + Trajectory.of(other), Trajectory.of(full))
    # another --seed: other mock samples (another run, not a rounding difference), said in one line
    pretrain_gpt.main(_argv(str(tmp_path / "seed"), ITERS, ["--load", str(tmp_path / "part_stop"), "--seed", "99"]))
    out = capsys.readouterr().out
    assert out.count("> note: --seed 99 (the checkpoint's run: 7): the data are drawn or split otherwise") == 1, out
    assert "> note: the checkpoint was saved" not in out


def test_lora_with_adapter_dropout(tmp_path):
    """--lora-dropout draws its masks from a random stream of its own; the resume restores it."""
    base = str(tmp_path / "base")
    pretrain_gpt.main(LORA_COMMON + ["--train-iters", "2", "--save", base])
    lora = LORA_COMMON + LORA + ["--lora-dropout", "0.1", "--hidden-dropout", "0.1", "--pretrained-checkpoint", base]
    full, first, second = _stop_and_resume(tmp_path, lambda save: lora + ["--save", save])
    _assert_continues(full, first, second)


def test_a_transformer_engine_delayed_fp8_resume_says_it_starts_the_scaling_over(tmp_path, monkeypatch, capsys):
    """Through the stand-in TE package: the resume prints the note once; the first run prints none."""
    fake_te.install(monkeypatch)
    te = ["--bf16", "--fp8-format", "hybrid", "--transformer-impl", "transformer_engine"]
    save = str(tmp_path / "te")
    pretrain_gpt.main(_argv(save, 4, te + ["--exit-interval", "3"]))
    assert "> note: --transformer-impl" not in capsys.readouterr().out
    assert pretrain_gpt.main(_argv(save, 4, te + ["--load", save])).iteration == 4
    assert capsys.readouterr().out.count("> note: --transformer-impl transformer_engine keeps the delayed-scaling") == 1
