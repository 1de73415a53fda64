"""--use-precision-aware-optimizer (megatron_lite/optim/precision_adam.py): Adam's moments stored in bf16.

One step of :class:`PrecisionAwareAdamW` equals an fp32 ``torch.optim.AdamW`` step whose moments are
afterwards rounded to bf16, bit for bit (the update is computed in fp32; the rounding happens once per
moment after it), over several steps, chunked or not, with a clip factor handed to the fused kernel; a
loaded state keeps its dtype; the flags' rules and refusals; the memory formula and the measured
optimizer state (bf16 moments: half of the fp32 moments' bytes).
"""

import pytest
import torch

from megatron_lite.config import Config
from megatron_lite.config_checks import finalize
from megatron_lite.errors import ConfigError
from megatron_lite.optim.precision_adam import PrecisionAwareAdamW, check_precision_aware_flags, moment_bytes
from megatron_lite.perf.model_state import model_state_bytes_split

BF16 = {"exp_avg": torch.bfloat16, "exp_avg_sq": torch.bfloat16}
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) for n in (3, 4, 7, 1)]


def _grads(step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(n, generator=g) * (10.0 ** -(i + 2)) for i, n in enumerate((3, 4, 7, 1))]


@pytest.mark.parametrize("chunk", [1 << 24, 5])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("dtypes", [BF16, {"exp_avg": torch.bfloat16, "exp_avg_sq": torch.float32}])
def test_each_step_equals_fp32_adamw_with_the_moments_rounded_after_it(chunk, fused, dtypes):
    mine = [p.clone() for p in _params()]
    ref = [p.clone() for p in _params()]
    groups = [{"params": mine[:2], "weight_decay": 0.1}, {"params": mine[2:], "weight_decay": 0.0}]
    opt = PrecisionAwareAdamW(groups, moment_dtypes=dtypes, chunk_numel=chunk, fused=fused, **HYPER)
    ref_opt = torch.optim.AdamW([{"params": ref[:2], "weight_decay": 0.1}, {"params": ref[2:], "weight_decay": 0.0}],
                                fused=fused, **HYPER)
    for step in range(3):
        for p, q, g in zip(mine, ref, _grads(step)):
            p.grad, q.grad = g.clone(), g.clone()
        if step == 2:  # a clip factor, as MegatronOptimizer hands it to the fused kernel
            opt.grad_scale = ref_opt.grad_scale = torch.tensor(4.0) if fused else None
        opt.step()
        ref_opt.step()
        for p, q in zip(mine, ref):
            assert torch.equal(p, q), f"step {step + 1}"
            for key, dtype in dtypes.items():
                stored, fp32 = opt.state[p][key], ref_opt.state[q][key]
                assert stored.dtype == dtype and torch.equal(stored, fp32.to(dtype)), (step, key)
                fp32.copy_(fp32.to(dtype))  # the reference carries the rounded moments on
        assert opt.param_groups[0]["params"] == mine[:2] and len(opt.param_groups) == 2


def test_the_rounding_changes_the_update():
    """Without the rounding the second step would equal fp32 Adam's: it does not (the test above has teeth)."""
    mine, ref = _params(), _params()
    opt = PrecisionAwareAdamW([{"params": mine}], moment_dtypes=BF16, **HYPER)
    ref_opt = torch.optim.AdamW([{"params": ref}], **HYPER)
    for step in range(2):
        for p, q, g in zip(mine, ref, _grads(step)):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    assert any(not torch.equal(p, q) for p, q in zip(mine, ref))


def test_a_loaded_state_keeps_the_moment_dtype():
    """torch's load_state_dict casts the moments to the param dtype (fp32); they are stored in bf16 again,
    and an fp32 saved state loads rounded to bf16."""
    params = _params()
    ref_opt = torch.optim.AdamW([{"params": params}], **HYPER)
    for p, g in zip(params, _grads(0)):
        p.grad = g
    ref_opt.step()
    opt = PrecisionAwareAdamW([{"params": [p.clone() for p in params]}], moment_dtypes=BF16, **HYPER)
    opt.load_state_dict(ref_opt.state_dict())
    for p, q in zip(opt.param_groups[0]["params"], params):
        assert opt.state[p]["exp_avg"].dtype == torch.bfloat16
        assert torch.equal(opt.state[p]["exp_avg"], ref_opt.state[q]["exp_avg"].bfloat16())


def _config(*flags) -> Config:
    cfg = Config()
    cfg.precision.use_precision_aware_optimizer = "aware" in flags
    cfg.precision.exp_avg_dtype = cfg.precision.exp_avg_sq_dtype = "bf16" if "bf16" in flags else "fp32"
    cfg.parallel.use_distributed_optimizer = "distopt" in flags
    cfg.optim.optimizer = "sgd" if "sgd" in flags else "adam"
    return cfg


@pytest.mark.parametrize("flags, message", [
    (("bf16", "distopt"), "--exp-avg-dtype bf16 needs --use-precision-aware-optimizer"),
    (("aware", "bf16"), "--use-precision-aware-optimizer needs the distributed optimizer"),
    (("aware", "bf16", "distopt", "sgd"), "--use-precision-aware-optimizer with --optimizer sgd"),
])
def test_the_rules_of_megatron_lm_are_one_line_errors(flags, message):
    with pytest.raises(ConfigError, match=message):
        check_precision_aware_flags(_config(*flags))
    check_precision_aware_flags(_config("aware", "bf16", "distopt"))
    check_precision_aware_flags(_config("aware", "distopt"))  # fp32 moments: fp32 Adam


def test_finalize_checks_the_flags():
    with pytest.raises(ConfigError, match="needs the distributed optimizer"):
        finalize(_config("aware", "bf16"))


def test_the_formula_counts_bf16_moments_as_half():
    aware = _config("aware", "bf16", "distopt").precision
    assert moment_bytes(aware) == 4 and moment_bytes(_config().precision) == 8
    # bf16 params, ZeRO-1 over 4 ranks: 2 + 4 + (4 master + moments) / 4
    assert model_state_bytes_split(torch.bfloat16, "optim", 4)[0] == 6 + 3
    assert model_state_bytes_split(torch.bfloat16, "optim", 4, moments=4)[0] == 6 + 2
    assert model_state_bytes_split(torch.bfloat16, "optim", 4, moments=4, offload_fraction=0.5) == (7, 1.5)
