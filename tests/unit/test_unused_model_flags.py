"""MoE, MLA and MTP flags on a model without experts / MLA / MTP: they trained a plain dense model
and exited 0 (a forgotten --num-experts went unnoticed); so did --moe-router-bias-update-rate
without the expert bias, --moe-per-layer-logging with no router loss to log, and --kv-channels with
multi-latent attention. Each is now one line naming the flag and
the missing one, exit 2; the defaults, and the flags with the feature on, are accepted."""

import pytest

from megatron_lite.arguments import parse_args
from tests.cli_errors import parse_refused

BASE = ["--mock-data", "--vocab-size", "64", "--position-embedding-type", "rope"]


@pytest.mark.parametrize("flags, words", [
    (["--moe-router-topk", "4"], "--moe-router-topk 4 has no effect without --num-experts"),
    (["--moe-aux-loss-coeff", "1e-2"], "--moe-aux-loss-coeff 0.01 has no effect without --num-experts"),
    (["--moe-grouped-gemm"], "--moe-grouped-gemm has no effect without --num-experts"),
    (["--moe-layer-freq", "2"], "--moe-layer-freq 2 has no effect"),
    (["--moe-router-load-balancing-type", "seq_aux_loss"], "--moe-router-load-balancing-type seq_aux_loss"),
    (["--num-experts", "0", "--moe-ffn-hidden-size", "16"], "--moe-ffn-hidden-size 16 has no effect"),  # 0: dense
    # with experts: the rate of an expert bias that is off
    (["--num-experts", "4", "--moe-router-bias-update-rate", "0.01"],
     "--moe-router-bias-update-rate 0.01 has no effect without --moe-router-enable-expert-bias"),
    # an auxiliary-loss coefficient with no load-balancing loss to scale (it trained with none, exit 0)
    (["--num-experts", "4", "--moe-router-load-balancing-type", "none", "--moe-aux-loss-coeff", "1e-2"],
     "--moe-aux-loss-coeff 0.01 has no effect with --moe-router-load-balancing-type none"),
    (["--num-experts", "4", "--moe-router-load-balancing-type", "seq_aux_loss", "none",
      "--moe-aux-loss-coeff", "1e-4", "1e-2"], "--moe-aux-loss-coeff 0.0001 0.01 has no effect"),
    (["--num-experts", "4", "--moe-router-load-balancing-type", "seq_aux_loss", "none",
      "--moe-aux-loss-coeff", "1e-4"], "with --moe-router-load-balancing-type seq_aux_loss none"),
    # per-layer logging of router losses when there are none (aux coefficient 0, the default; no z-loss): it wrote nothing
    (["--num-experts", "4", "--moe-per-layer-logging"], "--moe-per-layer-logging writes each MoE layer's router losses"),
    (["--num-experts", "4", "--moe-router-load-balancing-type", "sinkhorn", "--moe-per-layer-logging"],
     "(--moe-aux-loss-coeff 0, no --moe-z-loss-coeff)"),
    (["--q-lora-rank", "16"], "--q-lora-rank 16 has no effect without --multi-latent-attention"),
    (["--kv-lora-rank", "16"], "--kv-lora-rank 16 has no effect without --multi-latent-attention"),
    (["--v-head-dim", "8"], "--v-head-dim 8 has no effect without --multi-latent-attention"),
    (["--qk-head-dim", "64"], "--qk-head-dim 64 has no effect without --multi-latent-attention"),  # docs/deepseek-v3.md
    (["--qk-pos-emb-head-dim", "32"], "--qk-pos-emb-head-dim 32 has no effect without --multi-latent-attention"),
    (["--multi-latent-attention", "--kv-channels", "8"], "--kv-channels 8 has no effect with --multi-latent-attention"),
    (["--mtp-loss-scaling-factor", "0.5"], "--mtp-loss-scaling-factor 0.5 has no effect without --mtp-num-layers"),
    # YaRN's flags where the rotary tables are plain RoPE (MLA's --rope-type rope, or a standard attention's default)
    (["--multi-latent-attention", "--rope-type", "rope", "--mscale", "0.5"],
     "--mscale 0.5 has no effect without --rope-type yarn"),
    (["--multi-latent-attention", "--rope-type", "rope", "--beta-fast", "16"],
     "--beta-fast 16.0 has no effect without --rope-type yarn"),
    (["--original-max-position-embeddings", "8192"], "--original-max-position-embeddings 8192 has no effect"),
    (["--rotary-scaling-factor", "40"], "--rotary-scaling-factor 40.0 has no effect without --rope-type yarn"),
    (["--mscale-all-dim", "1"], "--mscale-all-dim 1.0 has no effect without --rope-type yarn"),
    (["--no-yarn-correction-range-round-to-int"], "--no-yarn-correction-range-round-to-int has no effect"),
])
def test_a_flag_the_model_would_ignore_is_refused(capsys, flags, words):
    parse_refused(capsys, BASE + flags, words, world_size=1)


def test_defaults_and_used_flags_are_accepted():
    parse_args(BASE + ["--moe-layer-freq", "1", "--moe-aux-loss-coeff", "0", "--moe-router-topk", "2"], world_size=1)
    config = parse_args(BASE + ["--num-experts", "4", "--moe-router-topk", "4", "--moe-grouped-gemm",
                                "--multi-latent-attention", "--q-lora-rank", "16", "--v-head-dim", "8",
                                "--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.5"], world_size=1)
    assert config.moe.moe_router_topk == 4 and config.model.q_lora_rank == 16
    assert config.model.mtp_loss_scaling_factor == 0.5
    parse_args(BASE + ["--multi-latent-attention", "--kv-channels", "16"], world_size=1)  # the derived 64 / 4
    config = parse_args(BASE + ["--num-experts", "4", "--moe-router-score-function", "sigmoid",
                                "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.01"], world_size=1)
    assert config.moe.moe_router_bias_update_rate == 0.01
    for types, coeffs in ((["none"], ["0"]), (["seq_aux_loss", "none"], ["1e-4", "0"]), (["none"], [])):
        parse_args(BASE + ["--num-experts", "4", "--moe-router-load-balancing-type", *types]
                   + (["--moe-aux-loss-coeff", *coeffs] if coeffs else []), world_size=1)
    for losses in (["--moe-aux-loss-coeff", "1e-2"], ["--moe-router-load-balancing-type", "none", "--moe-z-loss-coeff",
                                                      "1e-3"]):  # z-loss is independent of the balancing type
        parse_args(BASE + ["--num-experts", "4", "--moe-per-layer-logging", *losses], world_size=1)
    # MLA's softmax scale reads the YaRN factor and --mscale-all-dim whatever --rope-type is
    parse_args(BASE + ["--multi-latent-attention", "--rope-type", "rope", "--rotary-scaling-factor", "40",
                       "--mscale-all-dim", "1"], world_size=1)
    parse_args(BASE + ["--multi-latent-attention", "--mscale", "0.5", "--beta-fast", "16"], world_size=1)  # yarn
    parse_args(BASE + ["--rope-type", "yarn", "--rotary-scaling-factor", "40", "--mscale", "0.5"], world_size=1)
