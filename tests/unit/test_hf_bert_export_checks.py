"""docs/checkpoints.md: exporting a BERT as megatron-bert refuses what that format cannot hold (RMSNorm,
RoPE, SwiGLU, no biases, GQA, --openai-gelu and the tanh bias-GeLU fusion, MoE), each in one line
naming the flag; a plain pre-LN BERT passes."""

import pytest

from megatron_lite.checkpoint.hf_bert import check_bert
from megatron_lite.errors import ConfigError

BASE = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "bias_gelu_fusion": False}


@pytest.mark.parametrize("change, flag", [
    ({"normalization": "RMSNorm"}, "--normalization RMSNorm"),
    ({"position_embedding_type": "rope"}, "--position-embedding-type rope"),
    ({"swiglu": True}, "--swiglu"),
    ({"disable_bias_linear": True}, "--disable-bias-linear"),
    ({"num_query_groups": 2}, "--num-query-groups 2"),
    ({"kv_channels": 4}, "--kv-channels 4"),
    ({"openai_gelu": True}, "--openai-gelu"),
    ({"bias_gelu_fusion": True}, "--bias-gelu-fusion"),
    ({"num_experts": 4}, "--num-experts"),
])
def test_bert_export_refuses_what_megatron_bert_cannot_express(change, flag):
    check_bert(BASE)
    with pytest.raises(ConfigError) as err:
        check_bert({**BASE, **change})
    message = str(err.value)
    assert message.startswith(flag) and "cannot be expressed in the megatron-bert format" in message
    assert "\n" not in message
