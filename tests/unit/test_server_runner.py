"""The followers' loop of the text-generation server (ranks other than 0 under torchrun): it
survives every error rank 0 survives (rank 0 answers it and serves on), so the next job still runs
on every rank; only rank 0's stop message ends it. The broadcast is faked: one process."""

import pytest

from megatron_lite.inference import server
from megatron_lite.inference.fields import RequestError
from megatron_lite.inference.sampling import NonFiniteLogitsError


class Engine:
    def __init__(self, errors):
        self.errors, self.jobs = list(errors), []

    def generate(self, prompts, params):
        self.jobs.append(prompts)
        error = self.errors.pop(0)
        if error is not None:
            raise error


@pytest.mark.parametrize("error", [RequestError("bad"), ValueError("prompt 0 is empty"), NonFiniteLogitsError(),
                                   RuntimeError("probability tensor contains either inf, nan or element < 0")])
def test_a_follower_survives_a_failed_job_and_runs_the_next(monkeypatch, capsys, error):
    messages = iter([(server._GENERATE, [[1]], None), (server._HEARTBEAT,), (server._GENERATE, [[2]], None),
                     (server._STOP,)])

    def broadcast(box, src):
        box[0] = next(messages)

    monkeypatch.setattr(server.dist, "broadcast_object_list", broadcast)
    monkeypatch.setattr(server.dist, "get_rank", lambda: 1)
    engine = Engine([error, None])
    runner = server.Runner.__new__(server.Runner)
    runner.engine, runner.world = engine, 2
    runner.follow()
    assert engine.jobs == [[[1]], [[2]]]
    if not isinstance(error, ValueError):
        assert f"rank 1: request failed: {type(error).__name__}" in capsys.readouterr().err
