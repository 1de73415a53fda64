"""--manual-gc, --manual-gc-interval, --no-manual-gc-eval: Python's collector is off for the run's
steps and runs where Megatron-LM runs it (the start, every interval, before and after evaluation),
and the process gets its collector back when the run returns."""

import gc

import pretrain_gpt
from megatron_lite.training import manual_gc
from tests.cli_errors import parse_refused

TINY = ["--mock-data", "--vocab-size", "64", "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
        "--seq-length", "8", "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "5",
        "--eval-interval", "3", "--eval-iters", "1", "--log-interval", "100"]


def _events(monkeypatch, flags):
    """The run's forward passes ("train"/"eval", with whether the collector was on) and collections."""
    events = []

    class Recorder:
        disable, enable, isenabled = staticmethod(gc.disable), staticmethod(gc.enable), staticmethod(gc.isenabled)

        @staticmethod
        def collect(generation=2):  # recorded, not run: a full collection of the test session's
            events.append(f"collect{generation}")  # objects took ~0.5 s each (the run ignores the count)
            return 0

    real_forward_step = pretrain_gpt.forward_step

    def forward_step(data_iterator, model):
        events.append(("train" if model.training else "eval") + ("" if gc.isenabled() else "-gc-off"))
        return real_forward_step(data_iterator, model)

    monkeypatch.setattr(manual_gc, "gc", Recorder)
    monkeypatch.setattr(pretrain_gpt, "forward_step", forward_step)
    assert gc.isenabled()
    pretrain_gpt.main(TINY + flags)
    assert gc.isenabled()  # given back
    return events


def test_collections_at_start_interval_and_around_evaluation(monkeypatch):
    events = _events(monkeypatch, ["--manual-gc", "--manual-gc-interval", "2"])
    t, e = "train-gc-off", "eval-gc-off"
    assert events == ["collect2", t, t, "collect2", t, "collect2", e, "collect0", t, "collect2", t,
                      "collect2", e, "collect0", "collect2", e, "collect0"]  # iterations 1-5, validation after 3 and at the
    # end, then the test pass (the mock data's test split) as one more evaluation


def test_no_manual_gc_eval_and_interval_zero_leave_only_the_first_collection(monkeypatch):
    events = _events(monkeypatch, ["--manual-gc", "--no-manual-gc-eval"])
    assert events == ["collect2"] + ["train-gc-off"] * 3 + ["eval-gc-off"] + ["train-gc-off"] * 2 + ["eval-gc-off"] * 2


def test_without_the_flag_the_collector_stays_automatic(monkeypatch):
    events = _events(monkeypatch, ["--manual-gc-interval", "2"])
    assert events == ["train"] * 3 + ["eval"] + ["train"] * 2 + ["eval"] * 2


def test_negative_interval_is_one_line_exit_2(capsys):
    parse_refused(capsys, TINY + ["--manual-gc", "--manual-gc-interval", "-1"],
                  "--manual-gc-interval must be at least 0, got -1")
