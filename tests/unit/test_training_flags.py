"""Training-loop flags: values no run can use are refused in one line naming the flag, exit 2,
before any work (they used to pass the checks and crash later with a traceback: a
ZeroDivisionError for --global-batch-size 0, numpy's ValueError for --seed -1, ...)."""

import pytest

from megatron_lite.arguments import parse_args

BASE = ["--mock-data", "--vocab-size", "64"]


@pytest.mark.parametrize("flags, words", [
    (["--global-batch-size", "0"], "--global-batch-size must be positive, got 0"),
    (["--global-batch-size", "-4"], "--global-batch-size must be positive, got -4"),
    (["--train-iters", "0", "--lr-decay-style", "constant"], "--train-iters must be at least 1, got 0 (Megatron-LM's "
     "--train-iters 0 evaluation-only run is --skip-train here, with --load; tools/evaluate.py evaluates a "
     "checkpoint too)"),
    (["--train-iters", "-3", "--lr-decay-style", "constant"], "--train-iters must be at least 1, got -3"),
    (["--eval-iters", "-1"], "--eval-iters must be at least 0, got -1"),
    (["--seed", "-1"], "--seed must be at least 0, got -1"),
    (["--lr-warmup-iters", "-3"], "--lr-warmup-iters must be at least 0, got -3"),
    (["--lr=-0.1", "--min-lr=-0.2"], "--lr must be at least 0, got -0.1"),
    (["--min-lr=-1e-5"], "--min-lr must be at least 0, got -1e-05"),  # Megatron asserts min_lr >= 0 too
    (["--save", "ckpt", "--save-interval", "-2"], "--save-interval must not be negative, got -2"),
])
def test_unusable_counts_are_one_line_exit_2(capsys, flags, words):
    with pytest.raises(SystemExit) as err:
        parse_args(BASE + flags, world_size=2)
    assert err.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], lines


@pytest.mark.parametrize("flags", [["--eval-iters", "0"], ["--lr", "0", "--min-lr", "0"], ["--seed", "0"],
                                   ["--train-iters", "1", "--lr-decay-style", "constant"]])
def test_the_smallest_usable_values_are_accepted(flags):
    parse_args(BASE + flags, world_size=1)


@pytest.mark.parametrize("script, flags, words", [
    ("pretrain_bert", ["--mask-prob", "2"], "--mask-prob must be in [0, 1], got 2.0"),
    ("pretrain_bert", ["--seq-length", "4"], "--seq-length 4 is too short for BERT"),
    # int(0.15 x (8 - 3)) = 0 predictions per sample: it trained with lm loss 0 at every step
    ("pretrain_bert", ["--seq-length", "8"], "--seq-length 8 with --mask-prob 0.15 predicts no token"),
    ("pretrain_bert", ["--seq-length", "9"], "use --seq-length >= 10 or a larger --mask-prob"),
    # the loss was 0 and every gradient 0 at every step
    ("pretrain_bert", ["--mask-prob", "0", "--bert-no-binary-head"], "--mask-prob 0 with --bert-no-binary-head leaves "
     "nothing to train"),
    # BERT's batch is not split over CP: it was an IndexError traceback in the position embedding
    ("pretrain_bert", ["--context-parallel-size", "2"], "--context-parallel-size > 1 is GPT-only"),
    # GPT's end-of-document options were accepted and did nothing (a BERT sample has no EOD token)
    ("pretrain_bert", ["--reset-position-ids"], "--reset-position-ids: GPT-only"),
    ("pretrain_bert", ["--reset-attention-mask", "--eod-mask-loss"], "--reset-attention-mask --eod-mask-loss: GPT-only"),
    ("pretrain_gpt", ["--mtp-num-layers", "1", "--position-embedding-type", "rope", "--reset-attention-mask"],
     "--mtp-num-layers with --reset-attention-mask"),
])
def test_check_args_mode_applies_the_scripts_own_rules(capsys, monkeypatch, script, flags, words):
    """MEGATRON_LITE_CHECK_ARGS=1 exits 2 with the line a real launch gives, not 0 ("arguments valid")."""
    import importlib

    monkeypatch.setenv("MEGATRON_LITE_CHECK_ARGS", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")  # a world that fits every layout below
    with pytest.raises(SystemExit) as err:
        importlib.import_module(script).main(BASE + flags)
    lines = capsys.readouterr()
    assert err.value.code == 2, lines.out
    assert len(lines.err.strip().splitlines()) == 1 and words in lines.err, lines.err


def test_pretrain_bert_takes_mask_prob_1_as_megatron_does(capsys, monkeypatch):
    """--mask-prob 1 (predict every token a sample's masking reaches) is a probability Megatron-LM
    takes; it was refused ('must be in [0, 1)') with no reason given."""
    import pretrain_bert

    monkeypatch.setenv("MEGATRON_LITE_CHECK_ARGS", "1")
    monkeypatch.setenv("WORLD_SIZE", "1")
    argv = ["--data-path", "x", "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", "v", "--mask-prob", "1"]
    with pytest.raises(SystemExit) as err:
        pretrain_bert.main(argv)
    assert err.value.code == 0, capsys.readouterr().err
    assert "arguments valid" in capsys.readouterr().out


def test_save_interval_0_saves_only_at_the_end(tmp_path):
    """As in Megatron-LM, --save-interval 0 means no periodic save (it was refused: 'must be at least 1')."""
    import pretrain_gpt
    save = tmp_path / "ckpt"
    pretrain_gpt.main(BASE + ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length",
                              "8", "--micro-batch-size", "2", "--global-batch-size", "2", "--eval-iters", "0",
                              "--lr-decay-style", "constant", "--train-iters", "3", "--save", str(save),
                              "--save-interval", "0"])
    assert sorted(p.name for p in save.iterdir() if p.name.startswith("iter_")) == ["iter_0000003"]


def test_pretrain_refuses_train_iters_0_as_the_command_line_does(tmp_path):
    """pretrain() called with a Config whose --train-iters is 0 (made or changed in code) trained
    nothing and saved the untrained weights as iteration 0, while the command line refuses
    --train-iters 0. It refuses it with the command line's message now, before writing anything."""
    import pretrain_gpt
    from megatron_lite.errors import ConfigError
    from megatron_lite.training.loop import pretrain

    save = tmp_path / "ckpt"
    config = parse_args(BASE + ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
                                "--seq-length", "8", "--micro-batch-size", "1", "--global-batch-size", "1",
                                "--eval-iters", "0", "--save", str(save)], world_size=1)
    config.training.train_iters = 0
    tokenizer = pretrain_gpt.build_tokenizer_for(config)
    pretrain_gpt.set_vocab(config, tokenizer)
    with pytest.raises(ConfigError, match=r"^--train-iters must be at least 1, got 0 \(Megatron-LM's --train-iters 0 evaluation-only run is --skip-train"):
        pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.forward_step,
                 pretrain_gpt.make_datasets_provider(tokenizer))
    assert not save.exists()


@pytest.mark.parametrize("flags, first", [(["--mask-prob", "0.15"], "--mask-prob"),
                                          (["--short-seq-prob=0.2"], "--short-seq-prob"),
                                          (["--bert-no-binary-head"], "--bert-no-binary-head"),
                                          (["--num-layer", "2", "--bert-load", "x"], "--bert-load")])
def test_pretrain_gpt_names_pretrain_berts_flags(capsys, flags, first):
    """pretrain_gpt.py --mask-prob got argparse's bare "unrecognized arguments"; it says whose flag it is."""
    import pretrain_gpt
    from megatron_lite.megatron_flags import BERT_ONLY
    from tests.doc_blocks import training_parser

    ours = set(training_parser("pretrain_bert.py")._option_string_actions)
    assert set(BERT_ONLY) == ours - set(training_parser("pretrain_gpt.py")._option_string_actions)
    with pytest.raises(SystemExit) as err:
        pretrain_gpt.main(BASE + flags)
    lines = capsys.readouterr().err.strip().splitlines()
    assert err.value.code == 2 and len(lines) == 1, lines
    assert f": error: {first} is pretrain_bert.py's flag (BERT pretraining), not this script's: drop it, or train " \
        "BERT with pretrain_bert.py" in lines[0], lines
