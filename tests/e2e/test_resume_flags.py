"""Resuming refuses what would silently change the run: another value of a model flag that keeps
every shape (--openai-gelu, --rotary-base, --norm-epsilon, ...; all of arch_flags.ARCHITECTURE_FLAGS)
unless --finetune, with --use-checkpoint-args taking them from the checkpoint; and another
learning-rate schedule (a larger --train-iters) unless --override-opt_param-scheduler or
--use-checkpoint-opt_param-scheduler says which to follow (Megatron-LM's rules)."""

import dataclasses

import pytest

import pretrain_gpt
from megatron_lite.arch_flags import ARCHITECTURE_FLAGS, SHAPE_FLAGS
from megatron_lite.checkpoint import CheckpointError
from megatron_lite.checkpoint.arch import SHAPE_OF, check_architecture
from megatron_lite.config import SECTIONS, Config
from tests.e2e.test_pretrain_gpt import MODEL, _argv, _one_line_exit_2
from tests.trajectory import Trajectory, assert_same_trajectory

# the saved model: every flag below away from its default
SAVED = ["--position-embedding-type", "rope", "--rotary-base", "5000", "--openai-gelu", "--norm-epsilon", "1e-6"]
CHANGES = {  # one flag changed at a time; the shapes stay the same
    "openai-gelu": (["--position-embedding-type", "rope", "--rotary-base", "5000", "--norm-epsilon", "1e-6"],
                    "--openai-gelu (this run: no --openai-gelu); load it with --openai-gelu"),
    "rotary-base": (["--position-embedding-type", "rope", "--rotary-base", "10000", "--openai-gelu",
                     "--norm-epsilon", "1e-6"], "--rotary-base 5000 (this run 10000); load it with --rotary-base 5000"),
    "norm-epsilon": (["--position-embedding-type", "rope", "--rotary-base", "5000", "--openai-gelu"],
                     "--norm-epsilon 1e-06 (this run 1e-05); load it with --norm-epsilon 1e-06"),
}


@pytest.fixture(scope="module", params=["torch", "torch_dist"])
def saved(request, tmp_path_factory):
    """A checkpoint at iteration 2 of 4, and the trajectory of resuming it with the same flags."""
    tmp = tmp_path_factory.mktemp(request.param)
    fmt = ["--ckpt-format", request.param]
    src = str(tmp / "src")
    pretrain_gpt.main(_argv(src, 4, MODEL + SAVED + fmt + ["--exit-interval", "2"]))
    same = Trajectory.of(pretrain_gpt.main(_argv(str(tmp / "same"), 4, MODEL + SAVED + fmt + ["--load", src])))
    return src, fmt, same


@pytest.mark.parametrize("flag", list(CHANGES))
def test_a_changed_model_flag_is_refused_on_resume_and_accepted_with_finetune(saved, flag, tmp_path, capsys):
    src, fmt, _ = saved
    flags, words = CHANGES[flag]
    argv = _argv(str(tmp_path / "x"), 4, MODEL + flags + fmt + ["--load", src])
    _one_line_exit_2(capsys, argv, words, "--use-checkpoint-args", "--finetune")
    tuned = pretrain_gpt.main(argv + ["--finetune"])  # a deliberate change: from iteration 0
    assert tuned.iteration == 4 and len(tuned.losses) == 4


def test_use_checkpoint_args_takes_the_model_flags_from_the_checkpoint(saved, tmp_path, capsys):
    """No model flag but --use-checkpoint-args: the same run as resuming with the saved flags."""
    src, fmt, same = saved
    capsys.readouterr()
    taken = pretrain_gpt.main(_argv(str(tmp_path / "taken"), 4, MODEL + fmt + ["--load", src, "--use-checkpoint-args"]))
    assert_same_trajectory(Trajectory.of(taken), same, steps=2)
    out = capsys.readouterr().out
    # named as on the command line (the line gave bare names: "openai-gelu True (was False)")
    for said in ("--openai-gelu (was no --openai-gelu)", "--rotary-base 5000 (was 10000)",
                 "--norm-epsilon 1e-06 (was 1e-05)", "--position-embedding-type rope (was learned_absolute)"):
        assert said in out, out


def test_use_checkpoint_args_takes_the_vocabulary_flags_and_a_left_out_seq_length(saved, tmp_path, capsys):
    """--use-checkpoint-args --mock-data without --vocab-size stopped at "--mock-data needs
    --vocab-size", and another --vocab-size was refused with the advice to pass --use-checkpoint-args,
    which did not take it (the message also said 124, NullTokenizer's count, for --vocab-size 123);
    without --seq-length it ran at the default 128 (with rope, silently another run than the saved one;
    with learned positions it stopped at "max-position-embeddings 16 is smaller than seq-length 128"). It
    takes the checkpoint's --vocab-size (both runs NullTokenizer), --make-vocab-size-divisible-by and,
    when left out, --seq-length now: the same run as resuming with the saved flags."""
    from megatron_lite.arguments import parse_args

    src, fmt, same = saved
    argv = _argv(str(tmp_path / "taken"), 4, fmt + ["--load", src, "--use-checkpoint-args"])
    left_out = {"--vocab-size", "--make-vocab-size-divisible-by", "--seq-length"}
    bare = [a for i, a in enumerate(argv) if not {a, argv[i - 1]} & left_out]
    assert len(bare) == len(argv) - 6
    capsys.readouterr()
    taken = pretrain_gpt.main(bare)
    assert_same_trajectory(Trajectory.of(taken), same, steps=2)
    out = capsys.readouterr().out
    assert ("--make-vocab-size-divisible-by 8 (was 128), --vocab-size 123 (was no --vocab-size), --seq-length 16 "
            "(was 128)") in out, out
    assert parse_args(bare + ["--seq-length", "8"], world_size=1).model.seq_length == 8  # given: kept


def test_use_checkpoint_args_needs_a_checkpoint(tmp_path, capsys):
    _one_line_exit_2(capsys, _argv(str(tmp_path / "x"), 4, MODEL + ["--use-checkpoint-args"]), "needs --load")
    _one_line_exit_2(capsys, _argv(str(tmp_path / "x"), 4, MODEL + ["--use-checkpoint-args", "--load",
                                                                   str(tmp_path / "empty")]), "holds no checkpoint")


def _field_values():
    config = Config()
    return {f.name: getattr(getattr(config, s), f.name) for s in SECTIONS for f in dataclasses.fields(getattr(config, s))}


def _other(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    return f"other-{value}"


@pytest.mark.parametrize("key", [k for k in ARCHITECTURE_FLAGS if k != "bert_no_binary_head"])
def test_every_architecture_flag_is_checked(key):
    """Data-driven: any flag in ARCHITECTURE_FLAGS (those added later too) is refused on resume when
    it differs, named as a flag with dashes and both values, with the saved value as the fix; a
    weights-only load (--finetune, --pretrained-checkpoint) refuses only the flags of SHAPE_FLAGS (the
    others can change on purpose), so the resume's refusal advises --finetune only for those others."""
    config = Config()
    values = _field_values()
    assert key in values, f"{key} is in ARCHITECTURE_FLAGS but is no config field"
    saved = dict(config.flat(), **{key: _other(values[key])})
    said = rf"(no )?--(no-)?{key.replace('_', '-')}\b[^,;]*\(this run[^;]*; load it with"
    shape = key in SHAPE_FLAGS and key not in SHAPE_OF  # those compared by shape: below
    for load in ("resume", "release"):  # a release checkpoint (converted) loaded by --load without --finetune
        with pytest.raises(CheckpointError, match=said + ".*--use-checkpoint-args") as err:
            check_architecture("ckpt", saved, config, load)
        assert ("--finetune" in str(err.value)) is not shape, err.value
    if shape:
        with pytest.raises(CheckpointError, match=said):
            check_architecture("ckpt", saved, config, "weights")
    else:
        check_architecture("ckpt", saved, config, "weights")


def test_a_weights_only_load_compares_the_softmax_type_by_its_sinks():
    """--softmax-type off-by-one holds the tensors of vanilla: --finetune may switch between them (the
    resume refusal advises it; it was refused too), but not to or from learnable (its sinks)."""
    config = Config()
    for saved_type, run_type in (("vanilla", "off-by-one"), ("off-by-one", "vanilla")):
        config.model.softmax_type = run_type
        saved = dict(config.flat(), softmax_type=saved_type)
        with pytest.raises(CheckpointError, match=f"--softmax-type {saved_type} .*--finetune to change them"):
            check_architecture("ckpt", saved, config)
        check_architecture("ckpt", saved, config, "weights")
    for saved_type, run_type in (("vanilla", "learnable"), ("learnable", "off-by-one")):
        config.model.softmax_type = run_type
        with pytest.raises(CheckpointError, match=rf"--softmax-type {saved_type} \(this run {run_type}\); load it with --softmax-type {saved_type}$"):
            check_architecture("ckpt", dict(config.flat(), softmax_type=saved_type), config, "weights")


def test_the_vocabulary_is_compared_on_resume_only():
    """A resume refuses another vocabulary; a converted or weights-only load fits its rows (a
    tokenizer with added tokens, a NullTokenizer's end-of-document id); the padding never counts."""
    config = Config()
    config.model.vocab_size, config.model.padded_vocab_size = 124, 128
    saved = dict(config.flat(), vocab_size=123, padded_vocab_size=256)
    with pytest.raises(CheckpointError, match=r"--vocab-size 122 \(this run 123\); load it with --vocab-size 122, or pass --use-checkpoint-args"):  # NullTokenizer's: the flags' values
        check_architecture("ckpt", saved, config)
    config.data.tokenizer_type = "GPT2BPETokenizer"  # a tokenizer's vocabulary is its own
    with pytest.raises(CheckpointError, match=r"a vocabulary of 123 tokens from --tokenizer-type GPT2BPETokenizer \(this run 124\); use the checkpoint's tokenizer \(--tokenizer-type GPT2BPETokenizer and its files\), or pass --finetune to change them on purpose$"):
        check_architecture("ckpt", dict(saved, tokenizer_type="GPT2BPETokenizer"), config)
    config.data.tokenizer_type = "TikTokenizer"  # whose vocabulary --vocab-size sets: the fix names it
    with pytest.raises(CheckpointError, match=r"use the checkpoint's tokenizer \(--tokenizer-type TikTokenizer --vocab-size 123 and its files\)"):
        check_architecture("ckpt", dict(saved, tokenizer_type="TikTokenizer"), config)
    config.data.tokenizer_type = "GPT2BPETokenizer"
    check_architecture("ckpt", saved, config, "release")
    check_architecture("ckpt", saved, config, "weights")
    check_architecture("ckpt", dict(saved, vocab_size=124), config)


def test_a_torch_resume_at_another_padding_names_make_vocab_size_divisible_by():
    """A torch checkpoint's padded vocabulary must be this run's; the refusal named padded-vocab-size
    128 (this run 124), which is no flag. It names --make-vocab-size-divisible-by when that is why."""
    from megatron_lite.checkpoint.arch import arch_differences

    config = Config()
    config.model.vocab_size, config.model.padded_vocab_size, config.model.make_vocab_size_divisible_by = 124, 124, 1
    saved = dict(config.flat(), padded_vocab_size=128, make_vocab_size_divisible_by=8)
    assert arch_differences(saved, config) == ["--make-vocab-size-divisible-by 8 (this run 1)",
                                               "a vocabulary padded to 128 rows (this run 124)"]
    config.model.padded_vocab_size = 128  # another divisor, the same padding: nothing to say
    assert arch_differences(dict(saved, make_vocab_size_divisible_by=64), config) == []


# ---------------------------------------------------------------------------------------------
# The learning-rate schedule


@pytest.fixture(scope="module")
def four_iters(tmp_path_factory):
    """Saved at iteration 2 of a 4-iteration run (linear decay to 0 over 4 steps, 2 of warmup)."""
    src = str(tmp_path_factory.mktemp("sched") / "src")
    pretrain_gpt.main(_argv(src, 4, MODEL + ["--exit-interval", "2"]))
    return src


def _lr_after(src, tmp_path, flags):
    """The learning rate after step 5 of a resumed run with --train-iters 6."""
    result = pretrain_gpt.main(_argv(str(tmp_path / "next"), 6, MODEL + flags + ["--load", src, "--exit-interval", "5"]))
    assert result.iteration == 5
    return result.optimizer.param_groups[0]["lr"]


def test_a_longer_run_is_refused_unless_told_which_schedule(four_iters, tmp_path, capsys):
    _one_line_exit_2(capsys, _argv(str(tmp_path / "x"), 6, MODEL + ["--load", four_iters]),
                     "--lr-decay-iters (default --train-iters) 6 in this run, 4 in the checkpoint",
                     "--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler")
    # this run's schedule: decays over 6 steps, so step 5 is 3/4 through the decay after 2 of warmup
    assert _lr_after(four_iters, tmp_path, ["--override-opt_param-scheduler"]) == pytest.approx(1e-2 * (1 - 3 / 4))
    # the checkpoint's: decayed to --min-lr 0 at step 4
    assert _lr_after(four_iters, tmp_path, ["--use-checkpoint-opt_param-scheduler"]) == 0.0
    _one_line_exit_2(capsys, _argv(str(tmp_path / "x"), 6, MODEL + [
        "--load", four_iters, "--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"]), "pick one")


def test_bias_gelu_fusion_counts_only_where_it_picks_the_tanh_gelu():
    """--no-bias-gelu-fusion changes a GeLU MLP with biases (exact GeLU instead of tanh), not a SwiGLU one."""
    config = Config()
    saved = dict(config.flat(), bias_gelu_fusion=False)
    with pytest.raises(CheckpointError, match=r"--no-bias-gelu-fusion \(this run: --bias-gelu-fusion\); load it with --no-bias-gelu-fusion"):
        check_architecture("ckpt", saved, config)
    config.model.swiglu = True
    check_architecture("ckpt", dict(config.flat(), bias_gelu_fusion=False), config)


def test_a_derived_flag_saved_unset_is_compared_through_the_flags_it_comes_from():
    """A converter's config leaves --rope-type / --ffn-hidden-size unset (derived when the model is built)."""
    config = Config()
    config.model.rope_type, config.model.ffn_hidden_size = "rope", 128
    check_architecture("ckpt", dict(config.flat(), rope_type=None, ffn_hidden_size=None), config, "release")
    with pytest.raises(CheckpointError, match="rope-type yarn"):
        check_architecture("ckpt", dict(config.flat(), rope_type="yarn"), config, "release")


def test_a_fresh_run_into_a_save_folder_holding_checkpoints_warns(tmp_path, capsys):
    """A second run with the first one's --save and no --load trained from scratch and silently took the
    folder's tracker over (the first run's latest iteration no longer the one --load finds). It still
    trains (Megatron-LM's behaviour), after one start-up warning naming the folder and --load; a run that
    resumes the folder, or a first run, gets none."""
    save = str(tmp_path / "ckpt")
    pretrain_gpt.main(_argv(save, 3, MODEL))
    assert "WARNING: --save" not in capsys.readouterr().out
    again = pretrain_gpt.main(_argv(save, 4, MODEL))
    assert again.iteration == 4 and len(again.losses) == 4
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("WARNING: --save")]
    assert warnings == [f"WARNING: --save {save} already holds checkpoints (latest: 3) that this run does not resume "
                        f"(no --load): its saves will replace that tracker; pass --load {save} to continue them, "
                        "or pick another --save"]
    pretrain_gpt.main(_argv(save, 5, MODEL + ["--load", save, "--override-opt_param-scheduler"]))
    assert "WARNING: --save" not in capsys.readouterr().out
