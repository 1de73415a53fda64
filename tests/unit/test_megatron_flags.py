"""A Megatron-LM flag that megatron_lite lacks is refused in one line that says so, why and what to
do (megatron_lite/megatron_flags.py), exit code 2; a typo gets the closest flag of ours; the
Megatron-LM flags accepted as equivalents parse and set their field."""

import contextlib
import io
import os
import sys

import pytest

import megatron_lite.arguments as arguments
from megatron_lite.arguments import build_parser, parse_args
from megatron_lite.megatron_flags import (
    ENTRIES,
    REFUSED,
    REFUSED_VALUES,
    megatron_value_message,
)
from tests.cli_errors import parse_refused
from tests.doc_blocks import REPO, training_parser

BASE = ["--mock-data", "--vocab-size", "64"]
ACCEPTED = {"--use-mcore-models": ("training", "use_mcore_models"),
            "--use-cpu-initialization": ("training", "use_cpu_initialization"),
            "--accumulate-allreduce-grads-in-fp32": ("precision", "accumulate_allreduce_grads_in_fp32"),
            # asking for what megatron_lite always does: accepted as inert, not refused (see test below)
            "--grad-reduce-in-fp32": ("precision", "grad_reduce_in_fp32"),
            "--reduce-scatter-with-fp32-accumulation": ("precision", "reduce_scatter_with_fp32_accumulation"),
            "--ddp-reduce-scatter-with-fp32-accumulation": ("precision", "reduce_scatter_with_fp32_accumulation"),
            "--no-store-param-remainders": ("precision", "no_store_param_remainders"),
            "--use-contiguous-buffers-in-local-ddp": ("parallel", "use_contiguous_buffers_in_local_ddp"),
            "--tokenizer-hf-use-fast": ("data", "tokenizer_hf_use_fast"),
            "--tokenizer-hf-include-special-tokens": ("data", "tokenizer_hf_include_special_tokens"),
            "--no-ckpt-fully-parallel-save": ("checkpoint", "no_ckpt_fully_parallel_save"),
            "--dist-ckpt-optim-fully-reshardable": ("checkpoint", "dist_ckpt_optim_fully_reshardable"),
            "--disable-msc": ("checkpoint", "disable_msc"),
            "--no-one-logger": ("logging", "no_one_logger")}


def _refusal(parser, argv) -> tuple[int, list[str]]:
    """Exit code and stderr lines of ``parser.parse_args(argv)``, which must exit."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exc:
        parser.parse_args(argv)
    return exc.value.code, err.getvalue().strip().splitlines()


@pytest.mark.parametrize("script", ["pretrain_gpt.py", "pretrain_bert.py"])
def test_every_table_entry_is_refused_with_its_own_line(script):
    parser = training_parser(script)  # the parser the script's parse_args builds
    wrong = []
    for flag, (why, fix) in REFUSED.items():
        code, lines = _refusal(parser, BASE + [flag, "--num-layers", "2"])
        expected = f"{parser.prog}: error: {flag} is a Megatron-LM flag that megatron_lite does not support: {why}; {fix}"
        if code != 2 or lines != [expected]:
            wrong.append((flag, code, lines))
    assert not wrong, wrong[:5]
    assert len(REFUSED) > 300


def test_the_table_holds_no_flag_of_ours():
    """A flag added to our parser must leave the refusal table."""
    ours = set(training_parser("pretrain_gpt.py")._option_string_actions)
    ours |= set(training_parser("pretrain_bert.py")._option_string_actions)
    both = sorted(set(REFUSED) & ours)
    assert not both, f"now flags of ours: remove {both} from megatron_lite/megatron_flags.py"
    assert not set(ACCEPTED) & set(REFUSED)


def test_every_megatron_value_is_refused_with_its_own_line_and_none_is_ours():
    parser = build_parser()
    for flag, refused in REFUSED_VALUES.items():
        choices = parser._option_string_actions[flag].choices
        assert choices and not set(refused) & set(choices), f"now ours: drop {flag} {set(refused) & set(choices)}"
        for value, (why, fix) in refused.items():
            expected = f"is a Megatron-LM choice that megatron_lite does not support: {why}; {fix}"
            for argv in ([flag, value], [f"{flag}={value}"]):
                code, lines = _refusal(parser, BASE + argv + ["--num-layers", "2"])
                assert code == 2 and lines == [f"{parser.prog}: error: {flag} {value} {expected}"], lines
    assert _refusal(parser, BASE + ["--optimizer", "bogus"])[1][0].endswith(
        "invalid choice: 'bogus' (choose from 'adam', 'sgd', 'muon') (--help lists the flags)")


def test_entries_are_well_formed():
    flags = [f for names, _, _ in ENTRIES for f in names.split()]
    assert len(flags) == len(set(flags)), "a flag is in two entries"
    for names, why, fix in ENTRIES:
        assert why and fix and not why.endswith(".") and (fix == "drop it" or fix.split()[0] in
                                                          ("use", "drop", "point")), (names, fix)
        assert all(f.startswith("--") for f in names.split()), names


@pytest.mark.parametrize("argv, expected", [
    (["--num-layer", "2"], "error: unrecognized arguments: --num-layer (did you mean --num-layers?) "
                           "(--help lists the flags)"),
    (["--lr-warmup-iter=3"], "did you mean --lr-warmup-iters?"),
    (["--zzz-not-a-flag"], "error: unrecognized arguments: --zzz-not-a-flag (--help lists the flags)"),
    # a Megatron-LM flag is named first, whatever its place; the other unknown flags after it
    (["--num-layer", "2", "--tp-comm-overlap-cfg=x.yaml", "--foo"],
     "error: --tp-comm-overlap-cfg is a Megatron-LM flag that megatron_lite does not support"),
    (["--num-layer", "2", "--tp-comm-overlap-cfg=x.yaml", "--foo"], "; drop it [also not recognized: --num-layer --foo]"),
])
def test_unknown_flags(argv, expected):
    code, lines = _refusal(build_parser(), BASE + argv)
    assert code == 2 and len(lines) == 1 and expected in lines[0], lines


def test_no_suggestion_for_a_megatron_refusal_and_none_for_a_far_typo():
    code, lines = _refusal(build_parser(), ["--use-rotary-position-embeddings"])
    assert lines[0].endswith("Megatron-LM's deprecated switch for rotary embeddings; "
                             "use --position-embedding-type rope") and "did you mean" not in lines[0]
    assert "did you mean" not in _refusal(build_parser(), ["--qqqqqq"])[1][0]


def test_only_rank_0_prints(monkeypatch):
    monkeypatch.setattr(arguments, "PEER_EXIT_GRACE_S", 0.0)
    monkeypatch.setenv("RANK", "1")
    assert _refusal(build_parser(), ["--use-flash-attn"]) == (2, [])
    monkeypatch.setenv("RANK", "0")
    assert _refusal(build_parser(), ["--use-flash-attn"])[0] == 2


@pytest.mark.parametrize("flag", sorted(ACCEPTED))
def test_accepted_equivalents_parse_and_set_their_field(flag):
    section, name = ACCEPTED[flag]
    assert getattr(getattr(parse_args(BASE), section), name) is False
    assert getattr(getattr(parse_args(BASE + ["--bf16", flag]), section), name) is True


def test_pretrain_gpt_refuses_a_pasted_megatron_flag_in_one_line(monkeypatch, capsys):
    """Megatron-LM's Llama-3 recipe flags up to its first one we lack: exit 2, one line, nothing run
    (pretrain_gpt.py's main in this process, named as the script launched as users launch it)."""
    import pretrain_gpt

    argv = ["--use-mcore-models", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--group-query-attention", "--num-query-groups", "2", "--position-embedding-type", "rope",
            "--swiglu", "--attention-backend", "fused", "--bf16", "--accumulate-allreduce-grads-in-fp32",
            "--use-cpu-initialization", "--train-iters", "1"] + BASE
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as stop:
        pretrain_gpt.main(argv)
    out, err = capsys.readouterr()
    assert stop.value.code == 2, err
    refusal = megatron_value_message(["--attention-backend", "fused"])
    assert err.strip().splitlines() == [f"pretrain_gpt.py: error: {refusal}"]
    assert out == ""


RECIPE_FLAGS = """
--num-layers --hidden-size --num-attention-heads --seq-length --max-position-embeddings --attention-backend
--micro-batch-size --global-batch-size --rampup-batch-size --train-iters --weight-decay --adam-beta1 --adam-beta2
--init-method-std --clip-grad --fp16 --lr --lr-decay-style --min-lr --lr-warmup-fraction --lr-decay-iters
--tensor-model-parallel-size --pipeline-model-parallel-size --data-path --vocab-file --merge-file --split
--log-interval --save-interval --eval-interval --save --load --eval-iters --tensorboard-dir
--use-mcore-models --ffn-hidden-size --group-query-attention --num-query-groups --kv-channels
--position-embedding-type --rotary-base --rotary-percent --attention-dropout --hidden-dropout --swiglu
--apply-layernorm-1p --untie-embeddings-and-output-weights --disable-bias-linear --train-samples
--lr-decay-samples --lr-warmup-samples --decoupled-lr --decoupled-min-lr --bf16 --grad-reduce-in-bf16
--cross-entropy-loss-fusion --calculate-per-token-loss --manual-gc --empty-unused-memory-level
--exit-duration-in-mins --fp8-format --fp8-amax-history-len --fp8-amax-compute-algo --fp8-param-gather
--context-parallel-size --sequence-parallel --use-distributed-optimizer --overlap-grad-reduce
--overlap-param-gather --mock-data --tokenizer-type --vocab-size --data-cache-path --tiktoken-pattern
--no-create-attention-mask-in-dataloader --no-mmap-bin-files --num-workers --tokenizer-model --log-throughput
--profile --profile-step-start --profile-step-end --ckpt-format --distributed-timeout-minutes --normalization
--no-masked-softmax-fusion --no-position-embedding --num-experts --moe-router-topk
--moe-router-load-balancing-type --moe-aux-loss-coeff --moe-grouped-gemm --moe-token-dispatcher-type
--expert-model-parallel-size --no-load-optim --no-load-rng --wandb-project --wandb-exp-name --lr-warmup-iters
""".split()


def test_every_flag_of_megatron_lms_example_recipes_is_ours_or_explained():
    ours = set(training_parser("pretrain_gpt.py")._option_string_actions)
    unexplained = [f for f in RECIPE_FLAGS if f not in ours and f not in REFUSED]
    assert not unexplained, f"add to megatron_lite/megatron_flags.py: {unexplained}"


# Megatron-LM's Transformer Engine / FP8 flags (arguments.py's transformer-engine group and the amax reduction)
FP8_FLAGS = """
--transformer-impl --fp8-format --fp8-recipe --fp8-margin --fp8-interval --fp8-amax-history-len
--fp8-amax-compute-algo --no-fp8-wgrad --fp8-param-gather --first-last-layers-bf16 --num-layers-at-start-in-bf16
--num-layers-at-end-in-bf16 --fp8-dot-product-attention --fp8-multi-head-attention --tp-only-amax-red
--te-rng-tracker --inference-rng-tracker --keep-fp8-transpose-cache
""".split()


def test_every_megatron_fp8_flag_is_ours_or_explained():
    """--fp8-dot-product-attention, --fp8-multi-head-attention and --tp-only-amax-red got argparse's bare
    'unrecognized arguments' instead of the table's one line."""
    ours = set(training_parser("pretrain_gpt.py")._option_string_actions)
    unexplained = [f for f in FP8_FLAGS if f not in ours and f not in REFUSED]
    assert not unexplained, f"add to megatron_lite/megatron_flags.py: {unexplained}"


@pytest.mark.parametrize("alias, field_name, value", [
    (["--override-opt-param-scheduler"], "override_opt_param_scheduler", True),
    (["--use-checkpoint-opt-param-scheduler"], "use_checkpoint_opt_param_scheduler", True),
    (["--persistent-save-interval", "7"], "save_interval", 7),
    (["--use-custom-fsdp"], "use_megatron_fsdp", True),  # Megatron-FSDP's older name, in many Megatron scripts
    # newer Megatron-LM names a switch that is on by default --no-x and --disable-x
    (["--disable-save-optim"], "no_save_optim", True), (["--disable-save-rng"], "no_save_rng", True),
    (["--disable-load-optim"], "no_load_optim", True), (["--disable-load-rng"], "no_load_rng", True),
])
def test_megatron_second_spellings_set_the_same_field(alias, field_name, value):
    """Megatron-LM takes these flags under two names; both set the one field here."""
    ns = build_parser().parse_args(BASE + alias)
    assert [v for k, v in vars(ns).items() if k.endswith("." + field_name)] == [value]


def test_recompute_activations_is_selective_recomputation_and_conflicts_with_full(capsys):
    """Megatron-LM's shorthand: the model gets selective recomputation; with full it is refused."""
    from megatron_lite.models.transformer_config import TransformerConfig
    from tests.cli_errors import parse_refused

    assert parse_args(BASE).training.recompute_granularity is None
    config = parse_args(BASE + ["--recompute-activations"])
    assert config.training.recompute_granularity == "selective"
    assert TransformerConfig.from_config(config).recompute_granularity == "selective"
    assert parse_args(BASE + ["--recompute-activations", "--recompute-granularity", "selective"]
                      ).training.recompute_granularity == "selective"
    parse_refused(capsys, BASE + ["--recompute-activations", "--recompute-granularity", "full"],
                  "--recompute-activations", "full")



def test_moe_layer_recompute_is_selective_recomputation_of_the_moe_layers(capsys):
    """Megatron-LM's deprecated --moe-layer-recompute (in its Qwen3 / Mixtral recipes) was refused;
    it means selective recomputation with moe added to the modules (core_attn by default)."""
    from megatron_lite.models.transformer_config import TransformerConfig
    from tests.cli_errors import parse_refused

    moe = BASE + ["--num-experts", "4", "--moe-layer-recompute"]
    config = parse_args(moe)
    assert (config.training.recompute_granularity, config.training.recompute_modules) == ("selective", ["core_attn", "moe"])
    assert TransformerConfig.from_config(config).recompute_modules == ["core_attn", "moe"]
    config = parse_args(moe + ["--recompute-granularity", "selective", "--recompute-modules", "layernorm"])
    assert config.training.recompute_modules == ["layernorm", "moe"]
    parse_refused(capsys, moe + ["--recompute-granularity", "full", "--recompute-method", "uniform"],
                  "--moe-layer-recompute", "full")
    parse_refused(capsys, BASE + ["--moe-layer-recompute"], "--moe-layer-recompute", "--num-experts")

def test_megatron_hf_tokenizer_flags_are_explained():
    """Megatron-LM's HuggingFaceTokenizer switches (in its Qwen3 / Llama recipes) were 'unrecognized
    arguments'; the one asking for the slow tokenizer is refused with what megatron_lite's
    HuggingFaceTokenizer does instead; the two asking for what it always does are accepted."""
    parser = training_parser("pretrain_gpt.py")
    code, lines = _refusal(parser, BASE + ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-hf-no-use-fast"])
    assert code == 2 and len(lines) == 1 and "--tokenizer-hf-no-use-fast is a Megatron-LM flag" in lines[0], lines
    assert "tokenizers package (the fast tokenizer)" in lines[0]
    parser.parse_args(BASE + ["--tokenizer-hf-use-fast", "--tokenizer-hf-include-special-tokens"])


def test_flags_asking_for_what_we_always_do_are_accepted_and_say_so():
    """A Megatron-LM flag whose requested behaviour megatron_lite always has (--grad-reduce-in-fp32,
    --reduce-scatter-with-fp32-accumulation: gradients are reduced in fp32) is accepted as inert, like
    --accumulate-allreduce-grads-in-fp32, with a help text saying so (and listed in docs/flags.md);
    the ones asking for something else (--grad-reduce-in-bf16) stay refused."""
    parser = build_parser()
    for flag in ACCEPTED:
        assert parser._option_string_actions[flag].help.startswith("Accepted for Megatron"), flag
    assert "--grad-reduce-in-bf16" in REFUSED and not set(FP32_VALUE_FLAGS) & set(REFUSED)
    flags_md = open(os.path.join(REPO, "docs", "flags.md"), encoding="utf-8").read()
    accepted_list = flags_md.split("Accepted because they name what megatron_lite always does")[1].split("Refused")[0]
    assert all(f"`{flag}`" in accepted_list for flag in [*ACCEPTED, *FP32_VALUE_FLAGS]), accepted_list


FP32_VALUE_FLAGS = {"--main-grads-dtype": "main_grads_dtype", "--main-params-dtype": "main_params_dtype",
                    "--megatron-fsdp-grad-comm-dtype": "megatron_fsdp_grad_comm_dtype"}


@pytest.mark.parametrize("flag", sorted(FP32_VALUE_FLAGS))
def test_value_flags_asking_for_fp32_are_inert_and_other_values_are_refused_by_name(flag):
    """Megatron-LM's precision-aware optimizer dtypes and Megatron-FSDP's gradient communication dtype
    were refused outright, fp32 (what always happens here) too; fp32 is now accepted and changes nothing,
    another value is refused naming the flag, the value and why."""
    parser = training_parser("pretrain_gpt.py")
    assert parser._option_string_actions[flag].help.startswith("Accepted for Megatron scripts: it changes nothing")
    plain = parse_args(BASE)
    config = parse_args(BASE + ["--bf16", flag, "fp32"])
    assert getattr(config.precision, FP32_VALUE_FLAGS[flag]) == "fp32"
    assert {k: v for k, v in config.flat().items() if k != FP32_VALUE_FLAGS[flag]} == \
        {k: v for k, v in parse_args(BASE + ["--bf16"]).flat().items() if k != FP32_VALUE_FLAGS[flag]}
    assert plain.precision.main_grads_dtype == "fp32"  # Megatron-LM's default
    for value in ("bf16", "fp16"):
        code, lines = _refusal(parser, BASE + [f"{flag}={value}"])
        assert code == 2 and lines == [f"{parser.prog}: error: {flag} {value} is a Megatron-LM choice that "
                                       f"megatron_lite does not support: {REFUSED_VALUES[flag][value][0]}; use "
                                       f"{flag} fp32 or drop it"], lines
        assert "fp32" in REFUSED_VALUES[flag][value][0]


@pytest.mark.parametrize("flag", ["--exp-avg-dtype", "--exp-avg-sq-dtype"])
def test_adam_moment_dtypes_take_bf16_with_the_precision_aware_optimizer_and_refuse_fp16_and_fp8(flag, capsys):
    """--use-precision-aware-optimizer was refused and the moment dtypes took fp32 only: bf16 is now taken
    (with the precision-aware optimizer and the distributed optimizer, as in Megatron-LM: one line
    otherwise), fp16 and fp8 (Megatron-LM's scaled moments) are refused by value, naming the fix."""
    parser = training_parser("pretrain_gpt.py")
    aware = ["--use-precision-aware-optimizer", "--use-distributed-optimizer"]
    config = parse_args(BASE + ["--bf16", *aware, flag, "bf16"])
    assert config.precision.use_precision_aware_optimizer and getattr(config.precision, flag[2:].replace("-", "_")) == "bf16"
    parse_refused(capsys, BASE + ["--bf16", flag, "bf16"], f"{flag} bf16 needs --use-precision-aware-optimizer (as "
                  f"in Megatron-LM); add it or use {flag} fp32")
    parse_refused(capsys, BASE + ["--use-precision-aware-optimizer", flag, "bf16"], "needs the distributed optimizer")
    for value in ("fp16", "fp8"):
        code, lines = _refusal(parser, BASE + [*aware, f"{flag}={value}"])
        assert code == 2 and len(lines) == 1 and f"{flag} {value} is a Megatron-LM choice" in lines[0], lines
        assert "per-tensor scale" in lines[0] and f"use {flag} bf16" in lines[0], lines


def test_attention_backend_auto_of_megatron_lms_gpt3_example_is_inert():
    """Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh passes --attention-backend auto (its
    default): the flag was refused outright, so the example's command line stopped at it although auto is
    what always happens here. auto is accepted and changes nothing; flash, fused and local are refused
    by value, unfused pointing to --no-masked-softmax-fusion."""
    parser = training_parser("pretrain_gpt.py")
    assert parser._option_string_actions["--attention-backend"].help.startswith("Accepted for Megatron scripts")
    config = parse_args(BASE + ["--attention-backend", "auto"])
    assert config.fusion.attention_backend == "auto" and config.flat() == parse_args(BASE).flat()
    for value in ("flash", "fused", "local", "unfused"):
        code, lines = _refusal(parser, BASE + ["--attention-backend", value])
        assert code == 2 and lines == [f"{parser.prog}: error: {megatron_value_message(['--attention-backend', value])}"]


MEGATRON_FLAGS = os.path.join(REPO, "tests", "fixtures", "megatron_flags.txt")


def _megatron_flags() -> list[str]:
    """The frozen list of Megatron-LM's training flags (its header names the commit it was read from)."""
    with open(MEGATRON_FLAGS) as f:
        return [flag for line in f if not line.startswith("#") for flag in line.split()]


def test_every_megatron_lm_flag_is_ours_or_refused_with_a_reason():
    """Megatron-LM's flags that were neither ours nor in the table (--attention-output-gate, --qk-clip,
    --nccl-ub, --hybrid-context-parallel, ...) got argparse's bare 'unrecognized arguments'."""
    flags = _megatron_flags()
    assert len(flags) > 600 and all(f.startswith("--") for f in flags) and len(flags) == len(set(flags))
    ours = set(training_parser("pretrain_gpt.py")._option_string_actions)
    ours |= set(training_parser("pretrain_bert.py")._option_string_actions)
    unexplained = [f for f in flags if f not in ours and f not in REFUSED]
    assert not unexplained, f"add to megatron_lite/megatron_flags.py: {unexplained}"


@pytest.mark.parametrize("flag", ["--onnx-safe", "--qk-clip", "--hybrid-context-parallel",
                                  "--megatron-fsdp-main-params-dtype", "--outer-dp-sharding-strategy"])
def test_a_later_megatron_flag_is_refused_in_one_line(flag):
    code, lines = _refusal(training_parser("pretrain_gpt.py"), BASE + [flag])
    assert code == 2 and len(lines) == 1 and f"{flag} is a Megatron-LM flag that megatron_lite does not " \
                                               "support" in lines[0], lines


# Megatron-LM's choices of flags we have (arguments.py at the fixture's commit): each must be ours or refused.
MEGATRON_CHOICES = {
    "--fp8-recipe": "tensorwise delayed mxfp8 blockwise custom", "--fp8-format": "e4m3 hybrid",
    "--fp8-amax-compute-algo": "most_recent max", "--transformer-impl": "local transformer_engine",
    "--cross-entropy-fusion-impl": "native te", "--moe-token-dispatcher-type": "allgather alltoall flex",
    "--moe-router-load-balancing-type": "aux_loss seq_aux_loss global_aux_loss sinkhorn none",
    "--moe-router-dtype": "fp32 fp64", "--attention-backend": "flash fused unfused local auto", "--moe-router-score-function": "softmax sigmoid",
    "--moe-token-drop-policy": "probs position", "--recompute-granularity": "full selective",
    "--recompute-method": "uniform block", "--normalization": "LayerNorm RMSNorm",
    "--softmax-type": "learnable vanilla off-by-one", "--rope-type": "rope yarn", "--distributed-backend": "nccl gloo",
    "--data-parallel-sharding-strategy": "no_shard optim optim_grads optim_grads_params",
    "--weight-decay-incr-style": "constant linear cosine", "--cp-comm-type": "p2p a2a allgather a2a+p2p",
    "--tokenizer-type": "BertWordPieceLowerCase BertWordPieceCase GPT2BPETokenizer SentencePieceTokenizer "
                        "GPTSentencePieceTokenizer HuggingFaceTokenizer Llama2Tokenizer TikTokenizer MultimodalTokenizer "
                        "NullTokenizer NullMultimodalTokenizer SFTTokenizer",
    "--position-embedding-type": "learned_absolute rope mrope relative none",
    "--ckpt-format": "torch torch_dist zarr torch_dcp fsdp_dtensor",
    "--lr-decay-style": "constant linear cosine inverse-square-root WSD",
    "--lr-wsd-decay-style": "exponential linear cosine minus_sqrt", "--optimizer": "adam sgd muon dist_muon",
    "--dataloader-type": "single cyclic external",
    "--muon-scale-mode": "spectral unit_rms_norm shape_scaling", "--muon-tp-mode": "blockwise duplicated distributed",
    "--muon-fp32-matmul-prec": "low medium high",
}


@pytest.mark.parametrize("flag", sorted(MEGATRON_CHOICES))
def test_every_megatron_choice_is_ours_or_refused_with_a_reason(flag):
    """--fp8-recipe custom (Megatron-LM's quantizer-factory recipe) got argparse's bare 'invalid choice'."""
    action = build_parser()._option_string_actions[flag]
    unexplained = [v for v in MEGATRON_CHOICES[flag].split()
                   if v not in action.choices and v not in REFUSED_VALUES.get(flag, {})]
    assert not unexplained, f"{flag}: add {unexplained} to REFUSED_VALUES in megatron_lite/megatron_flags.py"


def test_attention_backend_unfused_points_to_the_unfused_softmax_flag():
    """Megatron's --attention-backend unfused asks for the explicit softmax math; its refusal said only
    'drop it', which leaves the fused SDPA path. It names our flag for that math."""
    parser = training_parser("pretrain_gpt.py")
    code, lines = _refusal(parser, BASE + ["--attention-backend", "unfused"])
    assert code == 2 and len(lines) == 1 and "--no-masked-softmax-fusion" in lines[0], lines
    assert "--no-masked-softmax-fusion" in parser._option_string_actions  # the flag it names exists
