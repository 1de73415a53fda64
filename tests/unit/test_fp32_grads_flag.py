"""--accumulate-allreduce-grads-in-fp32 is accepted as inert: every data-parallel strategy accumulates
and reduces gradients in fp32 already, under --bf16 and --fp16, with and without the flag."""

import contextlib

import pytest

from megatron_lite.arguments import parse_args

BASE = ["--mock-data", "--vocab-size", "64"]


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
def test_accumulate_allreduce_grads_in_fp32_is_what_every_strategy_does(strategy, monkeypatch):
    """--accumulate-allreduce-grads-in-fp32 is accepted because bf16 weights' gradients accumulate in,
    and are reduced from, fp32 buffers under every data-parallel sharding strategy."""
    import torch
    from torch import nn

    from megatron_lite.config import ParallelConfig
    from megatron_lite.parallel.fsdp import wrap_for_data_parallel
    from megatron_lite.parallel.grad_bucket import Bucket
    from megatron_lite.parallel.state import ParallelState

    reduced = []  # the dtype of every tensor a bucket's collective reduces
    launch = Bucket.launch
    monkeypatch.setattr(Bucket, "launch", lambda self, *a, **k: (reduced.append(self.data.dtype),
                                                                     launch(self, *a, **k))[1])
    model = nn.Sequential(nn.Linear(12, 10), nn.GELU(), nn.Linear(10, 4)).to(torch.bfloat16)
    ddp = wrap_for_data_parallel(model, ParallelState(), ParallelConfig(data_parallel_sharding_strategy=strategy,
                                                                        ddp_bucket_size=40))
    ddp.zero_grad_buffer()
    for seed in (1, 2):  # two micro-batches
        x = torch.randn(3, 12, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
        with ddp.no_sync() if seed == 1 else contextlib.nullcontext():
            ddp(x).float().square().sum().backward()
    ddp.finish_grad_sync()
    assert len(reduced) >= 2 and set(reduced) == {torch.float32}, reduced
    assert {ddp.owned_grad(p).dtype for p in ddp.params} == {torch.float32}


@pytest.mark.parametrize("precision", ["--bf16", "--fp16"])
@pytest.mark.parametrize("flag", [[], ["--accumulate-allreduce-grads-in-fp32"]])
def test_main_grads_are_fp32_sums_with_and_without_the_flag(precision, flag):
    """Through the flags, a GPT's 16-bit weights get fp32 main grads whether or not the flag is given:
    two micro-batches accumulate to the fp32 sum of each one's gradient, not to a 16-bit sum."""
    import torch

    import pretrain_gpt
    from megatron_lite.parallel.fsdp import wrap_for_data_parallel
    from megatron_lite.parallel.state import ParallelState

    config = parse_args(BASE + ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
                                "--seq-length", "8", "--hidden-dropout", "0", "--attention-dropout", "0",
                                precision, *flag], world_size=1)
    assert config.precision.accumulate_allreduce_grads_in_fp32 is bool(flag)
    state = ParallelState()
    ddp = wrap_for_data_parallel(pretrain_gpt.model_provider(config, state)[0], state, config.parallel)
    assert {p.dtype for p in ddp.params} == {config.precision.params_dtype}
    tokens = [torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(seed)) for seed in (1, 2)]

    def main_grads(batches):
        ddp.zero_grad_buffer()
        for i, batch in enumerate(batches):
            with ddp.no_sync() if i < len(batches) - 1 else contextlib.nullcontext():
                ddp(batch, labels=batch.roll(-1, dims=1)).float().mean().backward()
        ddp.finish_grad_sync()
        return [p.main_grad.clone() for p in ddp.params]

    first, second, both = main_grads(tokens[:1]), main_grads(tokens[1:]), main_grads(tokens)
    assert {g.dtype for g in both} == {torch.float32}
    for a, b, total in zip(first, second, both):
        torch.testing.assert_close(total, a + b, rtol=1e-6, atol=1e-9)
    low = config.precision.params_dtype  # a 16-bit accumulation would have rounded the sums
    assert any(not torch.equal((a + b).to(low).float(), a + b) for a, b in zip(first, second))


# The flags Megatron-LM's example recipes pass (examples/gpt3/train_gpt3_175b_distributed.sh,
# examples/llama/train_llama3_8b_h100_fp8.sh, examples/mixtral/train_mixtral_8x7b_distributed.sh,
# examples/bert/train_bert_340m_distributed.sh), torchrun's own left out.
