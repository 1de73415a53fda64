"""pretrain_gpt.forward_step feeds the dataset's fields to the model with the right conventions."""

import numpy as np
import torch

import pretrain_gpt
from megatron_lite.config import ModelConfig
from megatron_lite.data.gpt_dataset import ltor_fields
from megatron_lite.data.samplers import collate
from megatron_lite.parallel.state import ParallelState
from tests.model_helpers import build_gpt

EOD = 0


def _model():
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=12, ffn_hidden_size=64,
                      kv_channels=8, max_position_embeddings=12, num_query_groups=4, vocab_size=50,
                      padded_vocab_size=56, attention_dropout=0.0, hidden_dropout=0.0)
    return build_gpt(cfg, ParallelState(), seed=3)


def _batch(text, reset):
    tokens = np.asarray(text[:-1])
    fields = ltor_fields(tokens, EOD, eod_mask_loss=True, reset_position_ids=reset, reset_attention_mask=reset)
    sample = dict(tokens=tokens, labels=np.asarray(text[1:]), **fields)
    return collate([sample, sample])


def _loss(model, batch):
    out, loss_func = pretrain_gpt.forward_step(iter([batch]), model)
    return loss_func(out)[0]


def test_dataset_attention_mask_without_eod_equals_causal():
    model = _model()
    text = list(range(1, 14))  # no EOD: the reset mask is exactly the causal mask
    with_mask, plain = _batch(text, True), _batch(text, False)
    assert "document_ids" in with_mask and "document_ids" not in plain
    torch.testing.assert_close(_loss(model, with_mask), _loss(model, plain), rtol=1e-6, atol=1e-6)


def test_documents_after_eod_do_not_see_earlier_ones():
    model = _model()
    doc2 = [7, 8, 9, 10, 11]
    a = [3, 4, 5, 6, 2, 1, 9, EOD] + doc2
    b = [30, 31, 32, 33, 34, 35, 36, EOD] + doc2
    out_a, _ = pretrain_gpt.forward_step(iter([_batch(a, True)]), model)
    out_b, _ = pretrain_gpt.forward_step(iter([_batch(b, True)]), model)
    # per-token losses of the second document are independent of what came before the EOD
    torch.testing.assert_close(out_a[:, 8:], out_b[:, 8:], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(out_a[:, :7], out_b[:, :7])


def test_mtp_objective_is_lm_loss_plus_the_factor_over_depth_times_the_summed_depth_means():
    # loss_func with multi-token prediction: lm mean + mtp_loss_scaling_factor / D x (sum of the D
    # depths' masked means), each mean over its own mask; the reported values are the plain means.
    g = torch.Generator().manual_seed(0)
    losses = torch.rand(4, 2, 6, generator=g)  # [1 + D, b, s], D = 3
    mask = (torch.rand(2, 6, generator=g) > 0.3).float()
    mtp_mask = (torch.rand(3, 2, 6, generator=g) > 0.3).float()
    loss, reported = pretrain_gpt.loss_func(mask, losses, mtp_loss_mask=mtp_mask, mtp_loss_scaling_factor=0.3)
    masks = torch.cat([mask[None], mtp_mask])
    means = [(losses[k] * masks[k]).sum() / masks[k].sum() for k in range(4)]
    torch.testing.assert_close(loss, means[0] + 0.3 / 3 * (means[1] + means[2] + means[3]), rtol=1e-6, atol=0)
    for k in range(1, 4):
        torch.testing.assert_close(reported[f"mtp_{k} loss"], means[k], rtol=1e-6, atol=0)
    torch.testing.assert_close(reported["lm loss"], means[0], rtol=1e-6, atol=0)


def test_the_training_step_weighs_the_mtp_depths_by_the_flags_factor():
    """--mtp-loss-scaling-factor reaches the training step's loss (not loss_func's default 0.1)."""
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=12, ffn_hidden_size=64,
                      kv_channels=8, max_position_embeddings=12, num_query_groups=4, vocab_size=50,
                      padded_vocab_size=56, attention_dropout=0.0, hidden_dropout=0.0, mtp_num_layers=2,
                      position_embedding_type="rope",
                      mtp_loss_scaling_factor=0.5)
    model = build_gpt(cfg, ParallelState(), seed=3).train()
    out, loss_func = pretrain_gpt.forward_step(iter([_batch(list(range(1, 14)), reset=False)]), model)
    loss, reported = loss_func(out)
    want = reported["lm loss"] + 0.5 / 2 * (reported["mtp_1 loss"] + reported["mtp_2 loss"])
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=0)
