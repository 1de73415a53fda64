"""The auxiliary losses a --spec's modules log (moe/metrics.py plugin_loss_values) across ranks:
the values are the routers' reduction (summed over pipeline stages and TP partials, averaged over
the modules that log a name), every rank reports the same names, and the names are exchanged with
all_gather_object once, plus once more on the step a rank logs a new name, not on every step."""

import torch

from tests.harness import cached_state, run_ranks


class _CountingDist:
    """torch.distributed, counting all_gather_object."""

    def __init__(self, real):
        self.real, self.exchanges = real, 0

    def all_gather_object(self, *args, **kwargs):
        self.exchanges += 1
        return self.real.all_gather_object(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.real, name)


def _log_steps(pp: int, tp: int, steps: int, new_name_at: int):
    """Four steps of 2 micro-batches. Rank 0 has two modules logging "x" (2 * step and 4), rank 1 one
    module logging nothing until step ``new_name_at``, then "y" = 1; at TP2 both ranks hold one
    module whose "x" partials (rank + 1) sum to 3. Returns each step's values and the exchanges."""
    from megatron_lite.moe import metrics

    state = cached_state(pp=pp, tp=tp)
    rank = torch.distributed.get_rank()
    modules = [torch.nn.Module() for _ in range(2 if pp == 2 and rank == 0 else 1)]
    chunk = torch.nn.ModuleList(modules)  # the names are kept per model (its first chunk)
    counting, real = _CountingDist(metrics.dist), metrics.dist
    metrics.dist, logged = counting, []
    try:
        for step in range(1, steps + 1):
            for i, module in enumerate(modules):
                module.aux_losses = {}
                if tp == 2:
                    module.aux_losses["x"] = torch.tensor(float(rank + 1))
                elif rank == 0:
                    module.aux_losses["x"] = torch.tensor(2.0 * step if i == 0 else 4.0)
                elif step >= new_name_at:
                    module.aux_losses["y"] = torch.tensor(1.0)
            logged.append(metrics.plugin_loss_values([chunk], state, 2))
    finally:
        metrics.dist = real
    return logged, counting.exchanges


def test_pipeline_stages_report_the_same_values_and_exchange_names_only_when_new():
    ranks = run_ranks(2, _log_steps, 2, 1, 4, 3)
    expected = [{"x": (2.0 * s + 4.0) / 2 / 2, **({"y": 1.0 / 2} if s >= 3 else {})} for s in range(1, 5)]
    assert [logged for logged, _ in ranks] == [expected, expected]
    assert [exchanges for _, exchanges in ranks] == [2, 2]  # step 1 (x) and step 3 (y), not 4


def test_tensor_parallel_partials_sum_and_the_names_are_exchanged_once():
    ranks = run_ranks(2, _log_steps, 1, 2, 4, 99)
    assert [logged for logged, _ in ranks] == [[{"x": 3.0 / 2}] * 4] * 2
    assert [exchanges for _, exchanges in ranks] == [1, 1]
