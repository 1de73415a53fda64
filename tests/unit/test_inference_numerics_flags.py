"""A checkpoint trained with the 16-bit numerics flags (--fp32-residual-connection,
--attention-softmax-in-fp32, --apply-query-key-layer-scaling) is served with them: inference in the
training's 16-bit dtype computes the training model's logits, and a pipeline stage receives the
fp32 stream the previous one sends."""

import pytest
import torch

from megatron_lite.checkpoint import save_checkpoint
from megatron_lite.inference.engine import InferenceEngine
from megatron_lite.inference.loading import load_model
from megatron_lite.models import GPTModel, TransformerConfig
from megatron_lite.parallel.state import ParallelState
from tests.inference_helpers import VOCAB, randomize, run_config

TOKENS = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_inference_keeps_the_checkpoints_numerics_flags(tmp_path, dtype):
    config = run_config("gpt", str(tmp_path))
    config.precision.fp16, config.precision.bf16 = dtype == torch.float16, dtype == torch.bfloat16
    config.precision.fp32_residual_connection = True
    config.precision.apply_query_key_layer_scaling = dtype == torch.float16
    config.precision.attention_softmax_in_fp32 = True
    config.fusion.masked_softmax_fusion = False  # the unfused path, where the flags act
    state = ParallelState(world_size=1, rank=0)
    trained = GPTModel(TransformerConfig.from_config(config), state)
    randomize(trained, 3)
    save_checkpoint(1, [trained], None, None, 0, config, state)

    served, _ = load_model(str(tmp_path), params_dtype=dtype)
    for i, layer in enumerate(served.decoder.layers):
        core = layer.self_attention.core_attention
        assert core.softmax_in_fp32 and core.layer_scaling == (i + 1 if dtype == torch.float16 else 1)
    with torch.no_grad():
        served_logits, trained_logits = (m.eval()(TOKENS)[..., :VOCAB] for m in (served, trained))
        assert torch.equal(served_logits, trained_logits)  # the training model's (the padded vocabulary aside)
    assert InferenceEngine(served, vocab_size=VOCAB, max_sequence_length=16).stream_dtype == torch.float32
    plain, _ = load_model(str(tmp_path))  # fp32 inference: the flags change nothing
    assert InferenceEngine(plain, vocab_size=VOCAB, max_sequence_length=16).stream_dtype == torch.float32
