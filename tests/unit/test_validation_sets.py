"""Megatron-LM's validation flags: --multiple-validation-sets (each validation dataset evaluated on its
own, named by --validation-set-names), --full-validation (each pass reads the whole validation set once,
in full global batches) and --skip-train (evaluate the loaded model, train nothing, save nothing)."""

import glob
import os

import pytest
import torch

import pretrain_gpt
from megatron_lite.data.builder import build_train_valid_test_datasets, dataset_config_from_args
from tests.cli_errors import parse_refused
from tests.unit.test_data_builder import write

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "4", "--tokenizer-type",
        "NullTokenizer", "--vocab-size", "500", "--lr", "1e-2", "--seed", "3", "--log-interval", "1",
        "--eval-interval", "2", "--eval-iters", "2"]


@pytest.fixture
def data(tmp_path):
    """Train set a; validation sets b and c of different sizes and contents; the flags' cache folder."""
    paths = {n: write(tmp_path / n, docs, seed=s) for n, docs, s in (("a", 60, 1), ("b", 40, 2), ("c", 22, 3))}
    return paths, ["--data-cache-path", str(tmp_path / "cache")]


def _passes(result, kind):
    """(iteration, lm loss) of every pass of ``kind`` ("validation", "validation NAME", "test")."""
    return [(it, losses["lm loss"]) for it, name, losses in result.evaluations if name == kind]


def test_each_set_is_evaluated_on_its_own_as_a_run_validating_on_it_alone(data, capsys):
    """Two validation sets of different sizes: each set's losses are those of a run whose one validation
    split is that set (the same model at the same iterations), and they differ; the names label the lines."""
    (paths, cache) = data
    run = BASE + cache + ["--train-data-path", paths["a"]]
    both = pretrain_gpt.main(run + ["--valid-data-path", paths["b"], paths["c"], "--multiple-validation-sets",
                                    "--validation-set-names", "bee", "cee"])
    out = capsys.readouterr().out
    alone_b = pretrain_gpt.main(run + ["--valid-data-path", paths["b"]])
    alone_c = pretrain_gpt.main(run + ["--valid-data-path", paths["c"]])
    assert both.losses == alone_b.losses == alone_c.losses  # validation does not touch training
    assert _passes(both, "validation bee") == _passes(alone_b, "validation")
    assert _passes(both, "validation cee") == _passes(alone_c, "validation")
    assert [it for it, _ in _passes(both, "validation bee")] == [2, 4]
    assert all(b != c for (_, b), (_, c) in zip(_passes(both, "validation bee"), _passes(both, "validation cee")))
    assert "validation loss at iteration 4 on validation set cee | lm loss value:" in out
    assert both.validation == [(it, v) for it, v in _passes(both, "validation bee")]  # the first set's


def test_sets_are_numbered_without_names_and_split_from_data_path(data, capsys):
    """--data-path b c with --split: each prefix's validation part is a set, named 0 and 1."""
    (paths, cache) = data
    result = pretrain_gpt.main(BASE + cache + ["--data-path", paths["b"], paths["c"], "--split", "60,40,0",
                                               "--multiple-validation-sets"])
    assert [name for _, name, _ in result.evaluations] == ["validation 0", "validation 1"] * 2
    assert "validation loss at iteration 2 on validation set 1 |" in capsys.readouterr().out


def test_tensorboard_scalars_are_named_per_set(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron_lite.parallel.state import ParallelState
    from megatron_lite.training.logging import TrainLogger
    from tests.unit.test_logging import _config

    config = _config(tmp_path)
    config.logging.log_validation_ppl_to_tensorboard = True
    log = TrainLogger(config, ParallelState(), 1e9)
    log.log_validation(2, {"lm loss": 1.5}, name="web")
    log.log_validation(2, {"lm loss": 2.5}, name="code")
    log.log_validation(2, {"lm loss": 3.5}, prefix="iteration 2 on test set", scalars=False)
    log.close()
    [path] = glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))
    acc = EventAccumulator(path)
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"lm loss validation web", "lm loss validation code", "lm loss validation web ppl"} <= tags
    assert "lm loss validation" not in tags  # the test pass writes no scalar
    assert [e.value for e in acc.Scalars("lm loss validation code")] == [2.5]


def test_full_validation_reads_every_full_global_batch_of_the_set_each_pass(data, monkeypatch):
    """Set c's size is not a multiple of the global batch (4): each pass evaluates len // 4 global
    batches (2 micro-batches each), from its first sample, so two passes of the same model agree."""
    (paths, cache) = data
    flags = BASE + cache + ["--train-data-path", paths["a"], "--valid-data-path", paths["c"], "--full-validation"]
    size = len(build_train_valid_test_datasets(dataset_config_from_args(
        {"seq_length": 16, "train_data_path": [paths["a"]], "valid_data_path": [paths["c"]],
         "data_cache_path": cache[1]}), [0, None, 0])[1])
    assert size % 4 and size // 4 >= 2, size
    calls = []
    forward = pretrain_gpt.forward_step

    def counting(data_iterator, model):
        calls.append(model.training)
        return forward(data_iterator, model)

    monkeypatch.setattr(pretrain_gpt, "forward_step", counting)
    result = pretrain_gpt.main(flags + ["--lr", "0"])  # the model never changes: every pass reads the same
    assert calls.count(False) == 2 * (size // 4) * 2  # two passes (iterations 2 and 4), 2 micro-batches a batch
    (_, first), (_, second) = _passes(result, "validation")
    assert first == second


def test_skip_train_evaluates_the_loaded_iteration_as_the_run_that_saved_it(data, tmp_path, capsys):
    """The run that saved iteration 3 validated after saving (3 is no multiple of --eval-interval 2):
    --skip-train at the checkpoint reproduces that pass (and its test pass), trains nothing, writes nothing."""
    (paths, cache) = data
    save = str(tmp_path / "ck")
    run = BASE + cache + ["--train-data-path", paths["a"], "--valid-data-path", paths["b"], "--train-iters", "3"]
    trained = pretrain_gpt.main(run + ["--save", save])
    final = [e for e in trained.evaluations if e[0] == 3]
    before = sorted(os.listdir(save))
    capsys.readouterr()
    evaluated = pretrain_gpt.main(run + ["--load", save, "--save", save, "--skip-train", "--test-data-path",
                                         paths["c"]])
    out = capsys.readouterr().out
    assert evaluated.losses == [] and evaluated.iteration == 3 and evaluated.exit_reason == "skip-train"
    assert [e for e in evaluated.evaluations if e[1] == "validation"] == final
    assert [name for _, name, _ in evaluated.evaluations] == ["validation", "test"]
    assert "validation loss at iteration 3 on test set | lm loss value:" in out
    assert sorted(os.listdir(save)) == before and "saving checkpoint" not in out


def test_skip_train_with_full_validation_and_several_sets_equals_the_training_runs_passes(data, tmp_path):
    (paths, cache) = data
    save = str(tmp_path / "ck")
    run = BASE + cache + ["--train-data-path", paths["a"], "--valid-data-path", paths["b"], paths["c"],
                          "--multiple-validation-sets", "--full-validation"]
    trained = pretrain_gpt.main(run + ["--save", save])
    evaluated = pretrain_gpt.main(run + ["--load", save, "--skip-train"])
    assert evaluated.evaluations == [e for e in trained.evaluations if e[0] == 4] and len(evaluated.evaluations) == 2


def test_full_validation_leaves_the_eval_iters_position_in_the_checkpoint(data, tmp_path):
    """consumed_valid_samples counts --eval-iters passes only: a full pass starts at the first sample."""
    (paths, cache) = data
    run = BASE + cache + ["--train-data-path", paths["a"], "--valid-data-path", paths["b"]]
    for name, extra, expected in (("full", ["--full-validation"], 0), ("iters", [], 2 * 2 * 4)):
        pretrain_gpt.main(run + extra + ["--save", str(tmp_path / name)])
        [path] = glob.glob(str(tmp_path / name / "iter_0000004" / "mp_rank_00*" / "*.pt"))
        assert torch.load(path, weights_only=False)["consumed_valid_samples"] == expected


def test_per_token_loss_with_several_sets_is_each_sets_own(data):
    (paths, cache) = data
    run = BASE + cache + ["--train-data-path", paths["a"], "--calculate-per-token-loss", "--full-validation"]
    both = pretrain_gpt.main(run + ["--valid-data-path", paths["b"], paths["c"], "--multiple-validation-sets"])
    alone_c = pretrain_gpt.main(run + ["--valid-data-path", paths["c"]])
    assert _passes(both, "validation 1") == _passes(alone_c, "validation")


REFUSED_BASE = BASE + ["--train-data-path", "a", "--valid-data-path", "b", "c"]


@pytest.mark.parametrize("argv, words", [
    (REFUSED_BASE + ["--validation-set-names", "x", "y"], ["--validation-set-names", "--multiple-validation-sets"]),
    (REFUSED_BASE + ["--multiple-validation-sets", "--validation-set-names", "x"],
     ["--validation-set-names gives 1 name(s) for the 2 validation dataset(s) of --valid-data-path"]),
    (REFUSED_BASE + ["--multiple-validation-sets", "--validation-set-names", "x", "x"], ["given twice"]),
    (BASE + ["--train-data-path", "a", "--valid-data-path", "0.5", "b", "0.5", "c", "--multiple-validation-sets"],
     ["--valid-data-path takes prefixes only, no weights"]),
    (BASE + ["--data-path", "b", "c", "--split", "100,0,0", "--multiple-validation-sets"],
     ["--split 100,0,0", "validation split has weight 0"]),
    (BASE + ["--train-data-path", "a", "--multiple-validation-sets"], ["needs the validation datasets",
                                                                        "--valid-data-path"]),
    (BASE + ["--mock-data", "--full-validation"], ["--full-validation", "--mock-data"]),
    (BASE + ["--mock-data", "--multiple-validation-sets"], ["--multiple-validation-sets", "--mock-data"]),
    (REFUSED_BASE + ["--full-validation", "--eval-iters", "0"], ["--full-validation with --eval-iters 0"]),
    (REFUSED_BASE + ["--skip-train", "--eval-iters", "0"], ["--skip-train with --eval-iters 0"]),
])
def test_bad_combinations_are_refused_in_one_line(capsys, argv, words):
    parse_refused(capsys, argv, *words)


def test_full_validation_on_a_set_smaller_than_a_global_batch_is_refused(data, capsys):
    (paths, cache) = data
    tiny = write(os.path.join(os.path.dirname(paths["a"]), "tiny"), 1, seed=4)
    with pytest.raises(SystemExit) as exit_info:
        pretrain_gpt.main(BASE + cache + ["--train-data-path", paths["a"], "--valid-data-path", tiny,
                                          "--full-validation", "--global-batch-size", "64"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--full-validation: the validation split holds" in err[0] and "global batch" in err[0]


def test_a_resumed_run_validates_each_set_where_the_uninterrupted_run_does(data, tmp_path):
    """--eval-iters passes over two sets, stopped at 2 and resumed: the sets' passes at 4 read on from the
    checkpoint's position, as the uninterrupted run's do."""
    (paths, cache) = data
    run = BASE + cache + ["--train-data-path", paths["a"], "--valid-data-path", paths["b"], paths["c"],
                          "--multiple-validation-sets"]
    whole = pretrain_gpt.main(run)
    part = str(tmp_path / "part")
    first = pretrain_gpt.main(run + ["--save", part, "--exit-interval", "2"])
    resumed = pretrain_gpt.main(run + ["--save", part, "--load", part])
    assert first.evaluations + resumed.evaluations == whole.evaluations and len(whole.evaluations) == 4
