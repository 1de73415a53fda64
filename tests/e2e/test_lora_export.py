"""LoRA checkpoints through tools/checkpoint/convert.py: merged at another layout, and exported as a
Hugging Face PEFT adapter next to the exported base.

The adapted model is what the LoRA run computes (:func:`~megatron_lite.lora.convert.load_lora_gpt`:
the base plus the trained adapters in one process). Its logits must equal, within 1e-5 (fp32):
the merged checkpoint's (written at TP1 and PP2 from a TP2 + SP run; experts merged from an EP2 run)
and ``peft.PeftModel`` on the exported ``transformers`` model, for a GPT-2-, a Llama-, a Qwen2-style base
(--add-qkv-bias: its PEFT export was refused, the qwen2 style being new), a Qwen3-style one (--qk-layernorm)
a Qwen3-MoE one (a MoE layer of sequential experts and a dense one), a Mixtral one (grouped experts) and a
gpt-oss one (biases, sinks, clamped gated experts; its export was refused),
adapters on the attention, MLPs and routed experts (the experts' export was refused), and two DeepSeek-V3
ones (a dense and a MoE layer with a shared expert, adapters on the MLA projections, MLPs and routed
experts; their export was refused).
"""

import json
import os

import pytest
import torch

import pretrain_gpt
from megatron_lite.checkpoint import load_gpt_checkpoint
from megatron_lite.lora.convert import load_lora_gpt
from tests.e2e.test_lora import COMMON, MODELS
from tests.harness import run_ranks
from tests.tools import load_tool

LLAMA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
         "--group-query-attention", "--num-query-groups", "2", "--untie-embeddings-and-output-weights"]
STYLES = {"gpt2": [], "llama": LLAMA, "qwen2": LLAMA + ["--add-qkv-bias"],  # qwen2: exported as Qwen2ForCausalLM
          "qwen3": LLAMA + ["--qk-layernorm"],  # its q/k norms frozen with the base (Qwen3ForCausalLM)
          # Qwen3MoeForCausalLM, a MoE layer (sequential experts) then a dense one; MixtralForCausalLM, grouped experts
          "qwen3_moe": LLAMA + ["--qk-layernorm", "--num-experts", "4", "--moe-ffn-hidden-size", "32",
                                "--moe-layer-freq", "[1,0]"],
          "mixtral": LLAMA + ["--num-experts", "4", "--moe-ffn-hidden-size", "32", "--moe-grouped-gemm"],
          # GptOssForCausalLM: biases everywhere, attention sinks, clamped gated experts (sequential) on
          # transformers' transposed, gate/up-interleaved gate_up_proj
          "gpt_oss": [f for f in LLAMA if f not in ("--swiglu", "--disable-bias-linear")] + [
              "--quick-geglu", "--glu-linear-offset", "1", "--activation-func-clamp-value", "7",
              "--softmax-type", "learnable", "--num-experts", "4", "--moe-ffn-hidden-size", "32"]}
MLA_MOE = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
           "--untie-embeddings-and-output-weights", "--multi-latent-attention", "--kv-lora-rank", "8",
           "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6", "--qk-layernorm",
           "--norm-epsilon", "1e-6", "--num-experts", "4", "--moe-ffn-hidden-size", "16", "--moe-layer-freq", "[0,1]",
           "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
           "--moe-shared-expert-intermediate-size", "16"]
# DeepseekV3ForCausalLM, a dense layer then a MoE one: q compression and every MLA target, sequential experts;
# no q compression, its q_proj adapted, grouped experts
STYLES["deepseek_v3"] = MLA_MOE + ["--q-lora-rank", "16"]
STYLES["deepseek_v3_lite"] = MLA_MOE + ["--moe-grouped-gemm"]
MLA_TARGETS = {"deepseek_v3": ["--lora-target-modules", "linear_q_up_proj", "linear_kv_up_proj", "linear_proj",
                               "linear_fc1", "linear_fc2"],
               "deepseek_v3_lite": ["--lora-target-modules", "linear_q_proj", "linear_proj", "linear_fc1", "linear_fc2"]}
TOKENS = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
VOCAB = 65  # --vocab-size 64 plus the mock tokenizer's end-of-document token


def _train(argv):
    pretrain_gpt.main(argv)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: LoRA checkpoint}: gpt2 and llama styles in one process, dense at TP2 + SP, MoE
    (grouped experts) at EP2; each from a base pretrained for 2 steps, LoRA-trained for 3."""
    root, out = tmp_path_factory.mktemp("lora_export"), {}
    plan = {"gpt2": (STYLES["gpt2"], 1, []), "llama": (LLAMA, 1, []), "qwen2": (STYLES["qwen2"], 1, []),
            "qwen3": (STYLES["qwen3"], 1, []), "qwen3_moe": (STYLES["qwen3_moe"], 1, []),
            "mixtral": (STYLES["mixtral"], 1, []), "gpt_oss": (STYLES["gpt_oss"], 1, []),
            **{name: (STYLES[name], 1, targets) for name, targets in MLA_TARGETS.items()},
            "tp2": (STYLES["gpt2"], 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
            "ep2": (MODELS["moe_grouped"], 2, ["--expert-model-parallel-size", "2"])}
    for name, (model, world, layout) in plan.items():
        base, run = str(root / f"{name}_base"), str(root / name)
        pretrain_gpt.main(COMMON + model + ["--train-iters", "2", "--save", base])
        argv = COMMON + model + layout + ["--lora-rank", "4", "--lora-alpha", "8", "--train-iters", "3",
                                         "--pretrained-checkpoint", base, "--save", run, "--ckpt-format", "torch_dist"]
        run_ranks(world, _train, argv) if world > 1 else _train(argv)
        out[name] = run
    return out


def _convert(*argv):
    assert load_tool("checkpoint/convert").main(["--model-type", "GPT", *argv]) == 0


def _adapted_logits(run):
    model, _ = load_lora_gpt(run)
    with torch.no_grad():
        return model(TOKENS)[..., :VOCAB]


@pytest.mark.parametrize("run, target", [
    ("tp2", ["--target-tensor-parallel-size", "1"]),
    ("tp2", ["--target-tensor-parallel-size", "1", "--target-pipeline-parallel-size", "2"]),
    ("ep2", ["--target-expert-parallel-size", "1"]),
])
def test_merged_checkpoint_gives_the_adapted_logits(tmp_path, runs, run, target):
    want = _adapted_logits(runs[run])
    out = str(tmp_path / "merged")
    _convert("--load-dir", runs[run], "--save-dir", out, *target)
    merged, config = load_gpt_checkpoint(out)
    assert not config["lora_rank"]  # an ordinary checkpoint: loads anywhere without the LoRA flags
    assert not any("adapter" in k for k in merged.state_dict())
    with torch.no_grad():
        got = merged(TOKENS)[..., :VOCAB]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    base, _ = load_gpt_checkpoint(os.path.join(os.path.dirname(runs[run]), f"{run}_base"))
    with torch.no_grad():
        assert not torch.allclose(base(TOKENS)[..., :VOCAB], want, atol=1e-3)  # the adapters changed the model


@pytest.mark.parametrize("style", sorted(STYLES))
def test_peft_adapter_on_the_exported_base_gives_the_adapted_logits(tmp_path, runs, style):
    transformers, peft = pytest.importorskip("transformers"), pytest.importorskip("peft")
    want = _adapted_logits(runs[style])
    out = str(tmp_path / "hf")
    _convert("--saver", "hf", "--load-dir", runs[style], "--save-dir", out)
    config = json.load(open(os.path.join(out, "adapter", "adapter_config.json")))
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")
    if style in ("qwen3_moe", "mixtral", "gpt_oss") or style.startswith("deepseek"):  # the routed experts' adapters, trained (B != 0)
        assert {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"} <= set(config["target_parameters"])
        from safetensors.torch import load_file
        tensors = load_file(os.path.join(out, "adapter", "adapter_model.safetensors"))
        assert all(t.abs().max() > 0 for k, t in tensors.items() if ".experts." in k and "lora_B" in k)
    base = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, os.path.join(out, "adapter")).eval()
    with torch.no_grad():
        got = model(TOKENS).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    merged = str(tmp_path / "hf_merged")
    _convert("--saver", "hf", "--merge-lora", "--load-dir", runs[style], "--save-dir", merged)
    assert not os.path.exists(os.path.join(merged, "adapter"))
    with torch.no_grad():
        got = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()(TOKENS).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bad_lora_conversions_are_one_line(tmp_path, capsys, runs):
    tool = load_tool("checkpoint/convert").main
    base = os.path.join(os.path.dirname(runs["gpt2"]), "gpt2_base")
    assert tool(["--model-type", "GPT", "--saver", "hf", "--merge-lora", "--load-dir", base,
                 "--save-dir", str(tmp_path / "a")]) == 2
    assert tool(["--model-type", "GPT", "--saver", "hf", "--hf-style", "gpt_oss", "--load-dir", runs["ep2"],
                 "--save-dir", str(tmp_path / "b")]) == 2
    assert tool(["--model-type", "GPT", "--merge-lora", "--load-dir", runs["gpt2"],
                 "--save-dir", str(tmp_path / "c")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3 and "not a LoRA checkpoint" in lines[0], lines
    assert "cannot be expressed in the gpt_oss format" in lines[1], lines  # the base's refusal (a plain GPT MoE)
    assert "--merge-lora applies to --saver hf only" in lines[2]
    assert not os.path.exists(str(tmp_path / "b"))  # refused before anything was written


def test_expert_bias_trained_along_with_the_adapters_is_merged(tmp_path):
    """--moe-router-enable-expert-bias: the router's expert bias is a buffer the LoRA run keeps updating
    and saves with the adapters; the converter and load_lora_gpt take it from the LoRA checkpoint, so
    the merged model computes what the trained run computed (it was refused as a non-adapter tensor)."""
    model = MODELS["moe"] + ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                             "--moe-router-bias-update-rate", "0.1"]
    base, run, out = str(tmp_path / "base"), str(tmp_path / "lora"), str(tmp_path / "merged")
    pretrain_gpt.main(COMMON + model + ["--train-iters", "1", "--save", base])
    trained = pretrain_gpt.main(COMMON + model + ["--lora-rank", "4", "--lora-alpha", "8", "--train-iters", "3",
                                                  "--pretrained-checkpoint", base, "--save", run]).chunks[0]
    key = "decoder.layers.0.mlp.router.expert_bias"
    base_bias = load_gpt_checkpoint(base)[0].state_dict()[key]
    assert not torch.equal(trained.state_dict()[key], base_bias)  # the LoRA run moved the bias
    with torch.no_grad():
        want = trained.eval()(TOKENS)[..., :VOCAB]
        torch.testing.assert_close(_adapted_logits(run), want, rtol=1e-5, atol=1e-5)
    _convert("--load-dir", run, "--save-dir", out)
    merged, _ = load_gpt_checkpoint(out)
    assert torch.equal(merged.state_dict()[key], trained.state_dict()[key])
    with torch.no_grad():
        torch.testing.assert_close(merged(TOKENS)[..., :VOCAB], want, rtol=1e-5, atol=1e-5)


def test_inference_loaders_refuse_a_lora_checkpoint_saying_to_merge_it(tmp_path, capsys, runs):
    """tools/generate.py (inference.loading.load_model) and load_gpt_checkpoint on a LoRA checkpoint:
    one line saying it holds adapters only and how to merge them (was: 'the checkpoint has no tensor
    embedding.word_embeddings.weight; it does not fit the model its config describes'), exit 2."""
    from megatron_lite.checkpoint import CheckpointError
    from megatron_lite.inference.loading import load_model

    for load in (load_model, load_gpt_checkpoint):
        with pytest.raises(CheckpointError, match=r"is a LoRA checkpoint: .*convert\.py --model-type GPT --load-dir"):
            load(runs["gpt2"])
    code = load_tool("generate").main(["--load", runs["gpt2"], "--tokenizer-type", "NullTokenizer", "--vocab-size",
                                       "64", "--max-new-tokens", "2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "is a LoRA checkpoint" in err, err


def test_fp8_lora_checkpoint_merges(tmp_path):
    """A LoRA run with --fp8-format saves the FP8 bookkeeping of its frozen GEMMs (amax histories,
    scales) next to the adapters; converting it was refused ('holds non-adapter tensors'). The merged
    checkpoint holds weights only and gives the adapted logits (within the bf16 rounding of the merge)."""
    base, run, out = str(tmp_path / "base"), str(tmp_path / "lora"), str(tmp_path / "merged")
    pretrain_gpt.main(COMMON + ["--train-iters", "1", "--save", base])
    pretrain_gpt.main(COMMON + ["--bf16", "--fp8-format", "hybrid", "--lora-rank", "4", "--lora-alpha", "8",
                                "--train-iters", "2", "--pretrained-checkpoint", base, "--save", run])
    want = _adapted_logits(run)
    _convert("--load-dir", run, "--save-dir", out)
    merged, _ = load_gpt_checkpoint(out)
    with torch.no_grad():
        torch.testing.assert_close(merged(TOKENS)[..., :VOCAB], want, rtol=0, atol=1e-3)
        assert not torch.allclose(load_gpt_checkpoint(base)[0](TOKENS)[..., :VOCAB], want, atol=1e-2)
