"""MoE flag validation: every refused combination gives one line naming the flag; valid ones pass."""

import pytest

from megatron_lite.moe.config import MoEConfig, moe_config_problem, normalize
from megatron_lite.moe.layer_pattern import parse_moe_layer_freq


def _problem(tp=1, ep=1, sp=False, fp16=False, num_layers=4, **fields):
    moe = MoEConfig(**fields)
    normalize(moe, ffn_hidden_size=64)
    return moe_config_problem(moe, num_layers=num_layers, tp=tp, ep=ep, sequence_parallel=sp, fp16=fp16)


def test_layer_freq_patterns():
    assert parse_moe_layer_freq(1, 3) == [True, True, True]
    assert parse_moe_layer_freq("2", 4) == [True, False, True, False]
    assert parse_moe_layer_freq("([0]+[1]*3)", 4) == [False, True, True, True]
    assert parse_moe_layer_freq("[1,0,1,0]", 4) == [True, False, True, False]
    with pytest.raises(ValueError, match="list of 4"):
        parse_moe_layer_freq("[1]*3", 4)
    with pytest.raises(ValueError, match="only int lists"):
        parse_moe_layer_freq("__import__('os')", 4)
    assert parse_moe_layer_freq("2*[0,1]", 4) == [False, True, False, True]
    # an int sum or a list plus an int was a TypeError traceback from the CLI
    for bad in ("2+3", "[0]+1", "[1]*[2]", "3*4"):
        with pytest.raises(ValueError, match="only int lists"):
            parse_moe_layer_freq(bad, 4)
    with pytest.raises(ValueError, match="longer than any model"):  # was a MemoryError after filling the RAM
        parse_moe_layer_freq("[1]*100000000000", 4)


def test_valid_combinations_pass():
    assert _problem() is None  # dense
    assert _problem(num_experts=8, moe_router_topk=2, ep=2) is None
    assert _problem(num_experts=8, tp=2, sp=True, ep=2, moe_shared_expert_intermediate_size=32) is None
    assert _problem(num_experts=8, moe_router_topk=1, moe_router_pre_softmax=True) is None
    assert _problem(num_experts=8, moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"],
                    moe_aux_loss_coeff=[0.01, 0.001]) is None
    assert _problem(num_experts=8, moe_router_load_balancing_type=["sinkhorn"], moe_router_topk=1) is None
    # top-k exactly fills the kept groups (4 of 8 experts in 2 of 4 groups)
    assert _problem(num_experts=8, moe_router_num_groups=4, moe_router_group_topk=2, moe_router_topk=4) is None


def test_normalize_defaults():
    moe = MoEConfig(num_experts=0, moe_expert_capacity_factor=-1.0)
    normalize(moe, ffn_hidden_size=64)
    assert moe.num_experts is None and moe.moe_expert_capacity_factor is None
    moe = MoEConfig(num_experts=4, moe_router_load_balancing_type=["aux_loss", "z"], moe_aux_loss_coeff=[0.1])
    normalize(moe, ffn_hidden_size=64)
    assert moe.moe_ffn_hidden_size == 64 and moe.moe_aux_loss_coeff == [0.1, 0.1]


@pytest.mark.parametrize("kwargs,flag", [
    (dict(num_experts=6, ep=4), "--expert-model-parallel-size"),
    (dict(num_experts=4, moe_router_topk=5), "--moe-router-topk"),
    (dict(num_experts=4, moe_router_topk=1), "--moe-router-pre-softmax"),
    (dict(num_experts=4, tp=2), "--sequence-parallel"),
    (dict(num_experts=4, moe_router_load_balancing_type=["sinkhorn"], moe_expert_capacity_factor=1.0),
     "--moe-expert-capacity-factor"),
    (dict(num_experts=4, moe_router_load_balancing_type=["sinkhorn"], moe_aux_loss_coeff=[0.01]), "sinkhorn"),
    (dict(num_experts=4, moe_pad_expert_input_to_capacity=True), "--moe-expert-capacity-factor"),
    (dict(num_experts=4, moe_token_drop_policy="position"), "--moe-token-drop-policy position needs"),  # was ignored
    (dict(num_experts=8, moe_router_num_groups=3, moe_router_group_topk=1), "--moe-router-num-groups"),
    (dict(num_experts=8, moe_router_num_groups=4), "--moe-router-group-topk"),
    (dict(num_experts=4, moe_layer_freq="2+3"), "--moe-layer-freq"),  # was a TypeError traceback
    # the sigmoid router has no softmax to order: the flag was silently ignored
    (dict(num_experts=4, moe_router_score_function="sigmoid", moe_router_pre_softmax=True),
     "--moe-router-pre-softmax has no effect with --moe-router-score-function sigmoid"),
    # a factor of 0 was ignored, a negative one flipped every expert output; negative coefficients and rate
    # trained towards imbalance
    (dict(num_experts=4, moe_router_topk_scaling_factor=0.0), "--moe-router-topk-scaling-factor 0.0 must be positive"),
    (dict(num_experts=4, moe_router_topk_scaling_factor=-1.0), "--moe-router-topk-scaling-factor -1.0"),
    (dict(num_experts=4, moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"], moe_aux_loss_coeff=[0.01, -1.0]),
     "--moe-aux-loss-coeff -1.0 must not be negative"),
    (dict(num_experts=4, moe_z_loss_coeff=-1e-3), "--moe-z-loss-coeff -0.001 must not be negative"),
    (dict(num_experts=4, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
          moe_router_bias_update_rate=-0.1), "--moe-router-bias-update-rate -0.1 must not be negative"),
    (dict(num_experts=4, moe_input_jitter_eps=1.5), "--moe-input-jitter-eps 1.5 must be in [0, 1)"),  # flipped inputs
    (dict(num_experts=4, moe_input_jitter_eps=-0.1), "--moe-input-jitter-eps -0.1 must be in [0, 1)"),
    (dict(num_experts=4, moe_ffn_hidden_size=-4), "--moe-ffn-hidden-size -4"),  # was a RuntimeError traceback
    (dict(num_experts=4, moe_ffn_hidden_size=0), "--moe-ffn-hidden-size 0"),  # was experts of width 0
    (dict(num_experts=4, moe_expert_capacity_factor=0.0), "--moe-expert-capacity-factor 0"),  # dropped every token
    # the kept groups hold fewer than k experts: a top-k crash (k out of range) or an expert of weight 0
    (dict(num_experts=8, moe_router_num_groups=4, moe_router_group_topk=1, moe_router_topk=4), "--moe-router-topk 4"),
    (dict(num_experts=8, moe_router_num_groups=8, moe_router_group_topk=2, moe_router_topk=3), "--moe-router-topk 3"),
    (dict(num_experts=8, moe_router_enable_expert_bias=True), "--moe-router-score-function sigmoid"),
    (dict(num_experts=4, moe_token_dispatcher_type="flex"), "flex"),
    # sinkhorn routing takes none of the top-k routing's options (they were silently ignored; the bias kept updating)
    (dict(num_experts=4, moe_router_load_balancing_type=["sinkhorn"], moe_router_score_function="sigmoid",
          moe_router_enable_expert_bias=True), "--moe-router-enable-expert-bias has no effect"),
    (dict(num_experts=4, moe_router_load_balancing_type=["sinkhorn"], moe_router_num_groups=2, moe_router_group_topk=1),
     "--moe-router-num-groups has no effect"),
    (dict(num_experts=4, moe_router_load_balancing_type=["sinkhorn"], moe_router_score_function="sigmoid"),
     "--moe-router-score-function sigmoid has no effect"),
    (dict(num_experts=4, moe_router_load_balancing_type=["sinkhorn"], moe_router_pre_softmax=True),
     "--moe-router-pre-softmax has no effect"),
    (dict(num_experts=4, moe_router_load_balancing_type=["sinkhorn"], moe_router_topk_scaling_factor=2.0),
     "--moe-router-topk-scaling-factor has no effect"),
    (dict(num_experts=4, moe_permute_fusion=True), "--moe-permute-fusion"),
    (dict(num_experts=4, moe_router_fusion=True), "--moe-router-fusion"),
    (dict(num_experts=4, moe_enable_deepep=True), "--moe-enable-deepep"),
    (dict(num_experts=4, expert_tensor_parallel_size=3, tp=4, sp=True), "--expert-tensor-parallel-size 3"),  # ffn 8 % 3
    (dict(num_experts=4, ep=2, fp16=True), "--fp16"),
    (dict(num_experts=4, expert_tensor_parallel_size=2, fp16=True),  # docs: fp16 with a folded ETP
     "--expert-tensor-parallel-size other than 1 or --tensor-model-parallel-size does not support --fp16"),
    (dict(num_experts=4, moe_layer_freq="[1]*3"), "--moe-layer-freq"),
    (dict(ep=2), "--num-experts"),
    (dict(num_experts=4, moe_router_load_balancing_type=["aux_loss", "z_loss"], moe_aux_loss_coeff=[0.1, 0.2, 0.3]),
     "--moe-aux-loss-coeff"),
])
def test_bad_combinations_are_one_line_naming_the_flag(kwargs, flag):
    message = _problem(**kwargs)
    assert message is not None and flag in message and "\n" not in message, message


@pytest.mark.parametrize("flags", [
    ["--moe-router-fusion"], ["--moe-permute-fusion"], ["--moe-token-dispatcher-type", "flex"],
    ["--moe-enable-deepep"], ["--moe-apply-probs-on-input"], ["--moe-shared-expert-overlap"],
    ["--overlap-moe-expert-parallel-comm"], ["--moe-extended-tp"],
])
def test_the_gpu_only_and_unbuilt_flags_docs_list_are_refused_in_one_line(capsys, flags):
    """docs/mixture-of-experts.md names these as refused (exit 2, one line naming the flag), never ignored."""
    from tests.cli_errors import parse_refused

    parse_refused(capsys, ["--mock-data", "--vocab-size", "64", "--num-experts", "4", *flags], flags[0], world_size=1)
