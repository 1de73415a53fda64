"""A checkpoint trained at TP2 x PP2, converted with tools/checkpoint/convert.py, resumes in
pretrain_gpt.py at another layout and trains on exactly as it would have at the original one.

The converter reshards the optimizer state (here the distributed optimizer's, saved at TP2 x PP2,
loaded by the plain optimizer at TP1) and copies the schedule; RNG states are per rank and are not
carried, so both continuations run with ``--no-load-rng`` (dropout is 0). Every continued step's loss
and gradient norm must agree within rel 1e-5.
"""

import os
import shlex

import pytest
import torch

import pretrain_gpt
from megatron_lite.checkpoint import merge_checkpoint
from tests.e2e.test_pretrain_gpt import MODEL_B, _argv
from tests.tools import load_tool
from tests.trajectory import Trajectory, assert_same_trajectory, ranks_trajectory, run_trajectory

RESUME = ["--no-load-rng"]


def test_converted_checkpoint_resumes_at_a_new_layout_like_the_original(tmp_path):
    src, tp1 = str(tmp_path / "tp2pp2"), str(tmp_path / "tp1")
    layout = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    ranks_trajectory(4, "pretrain_gpt", _argv(src, 8, MODEL_B + layout + ["--use-distributed-optimizer", "--exit-interval", "4"]))
    convert = load_tool("checkpoint/convert").main
    assert convert(["--model-type", "GPT", "--loader", "megatron", "--saver", "megatron", "--load-dir", src,
                    "--save-dir", tp1, "--target-tensor-parallel-size", "1", "--target-pipeline-parallel-size", "1"]) == 0

    original = ranks_trajectory(4, "pretrain_gpt", _argv(str(tmp_path / "a"), 8, MODEL_B + layout + [
        "--load", src, "--use-distributed-optimizer"] + RESUME))
    converted = pretrain_gpt.main(_argv(str(tmp_path / "b"), 8, MODEL_B + ["--load", tp1] + RESUME))
    assert converted.iteration == 8  # resumed at iteration 4
    assert_same_trajectory(Trajectory.of(converted), original, steps=4)

    # back to TP2 x PP2: the optimizer state (moments, masters, groups, scaler) equals training's own
    back = str(tmp_path / "back")
    assert convert(["--model-type", "GPT", "--load-dir", tp1, "--save-dir", back, "--target-tensor-parallel-size", "2",
                    "--target-pipeline-parallel-size", "2"]) == 0
    for rank_dir in ("mp_rank_00_000", "mp_rank_01_000", "mp_rank_00_001", "mp_rank_01_001"):
        want, got = (torch.load(os.path.join(root, "iter_0000004", rank_dir, "model_optim_rng.pt"), weights_only=True)
                     for root in (src, back))
        assert got["scheduler"] == want["scheduler"]
        _same_optimizer(got["optimizer"], want["optimizer"], rows=123 - 64 * int(rank_dir[9]))


def test_convert_re_pads_the_vocabulary_for_another_tp_size(tmp_path):
    """124 vocabulary rows pad to 140 at TP2 and to 130 at TP1 (--make-vocab-size-divisible-by 10): a
    torch checkpoint converted from TP2 to TP1 holds 130 rows (real rows kept, padded rows zero, in
    the weights and the optimizer state) and resumes on the trajectory of resuming at TP2."""
    repad = MODEL_B + ["--make-vocab-size-divisible-by", "10", "--use-distributed-optimizer"]
    tp2 = ["--tensor-model-parallel-size", "2"]
    src, tp1 = str(tmp_path / "tp2"), str(tmp_path / "tp1")
    ranks_trajectory(2, "pretrain_gpt", _argv(src, 8, repad + tp2 + ["--exit-interval", "4"]))
    assert load_tool("checkpoint/convert").main(["--model-type", "GPT", "--load-dir", src, "--save-dir", tp1,
                                                 "--target-tensor-parallel-size", "1"]) == 0
    weights, saved = merge_checkpoint(tp1)
    assert saved["padded_vocab_size"] == 130
    state = torch.load(os.path.join(tp1, "iter_0000004", "mp_rank_00_000", "model_optim_rng.pt"), weights_only=True)
    vocab = [t for t in list(state["optimizer"]["fp32_masters"]) + [v for s in state["optimizer"]["optimizer"]["state"]
                                                                   .values() for v in s.values()]
             if torch.is_tensor(t) and t.dim() == 2 and t.shape[0] == 130]
    for t in vocab + [weights["embedding.word_embeddings.weight"], weights["output_layer.weight"]]:
        assert t.shape[0] == 130 and not t[124:].any() and t[:124].any()
    assert len(vocab) == 6  # masters, exp_avg, exp_avg_sq of the embedding and the untied output layer
    original = ranks_trajectory(2, "pretrain_gpt", _argv(str(tmp_path / "a"), 8, repad + tp2 + ["--load", src] + RESUME))
    converted = pretrain_gpt.main(_argv(str(tmp_path / "b"), 8, repad + ["--load", tp1] + RESUME))
    assert converted.iteration == 8
    assert_same_trajectory(Trajectory.of(converted), original, steps=4, what="converted from TP2 to TP1")


def _same_optimizer(got, want, rows):
    """Equal bit for bit; vocabulary-sized tensors (64 rows per TP rank here) on their real rows only."""
    assert got["loss_scaler"] == want["loss_scaler"] and got["num_skipped_steps"] == want["num_skipped_steps"]
    assert got["optimizer"]["param_groups"] == want["optimizer"]["param_groups"]
    pairs = [(got["fp32_masters"], want["fp32_masters"])]
    pairs += [(got["optimizer"]["state"][i], want["optimizer"]["state"][i]) for i in want["optimizer"]["state"]]
    assert got["optimizer"]["state"].keys() == want["optimizer"]["state"].keys()
    for a, b in pairs:
        for x, y in (zip(a, b, strict=True) if isinstance(a, list) else ((a[k], b[k]) for k in b)):
            n = min(rows, 64) if x.dim() == 2 and x.shape[0] == 64 else None
            assert torch.equal(x[:n], y[:n]) if x.dim() else torch.equal(x, y)


def test_torch_checkpoint_format_is_accepted(tmp_path):
    assert pretrain_gpt.main(_argv(str(tmp_path / "s"), 3, ["--ckpt-format", "torch"])).iteration == 3


def _flags_printed(capsys) -> list[str]:
    out = capsys.readouterr().out
    return shlex.split(out.split("load it with: ")[1].split(" (and the tokenizer flags)")[0])


def test_hf_import_continues_pretraining_with_the_printed_flags(tmp_path, capsys):
    """A Llama-style model imported at TP2 trains in pretrain_gpt.py from the converter's flags, with
    the same losses as the same import at TP1 (a release checkpoint: weights only, from iteration 0)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=123, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, tie_word_embeddings=False))
    hf.save_pretrained(str(tmp_path / "hf"))
    convert = load_tool("checkpoint/convert").main
    run = ["--mock-data", "--vocab-size", "123", "--micro-batch-size", "2", "--global-batch-size", "4",
           "--train-iters", "3", "--lr", "1e-3", "--eval-iters", "0", "--log-interval", "1"]
    runs = []
    for tp in (2, 1):
        capsys.readouterr()
        out = str(tmp_path / f"tp{tp}")
        assert convert(["--model-type", "GPT", "--loader", "hf", "--load-dir", str(tmp_path / "hf"), "--save-dir", out,
                        "--target-tensor-parallel-size", str(tp)]) == 0
        runs.append(run_trajectory(tp, "pretrain_gpt", _flags_printed(capsys) + run))
    assert_same_trajectory(runs[0], runs[1], steps=3)  # 3 steps: started at iteration 0


def test_fp8_checkpoint_converts_and_resumes_with_its_scales(tmp_path):
    """A checkpoint of a --fp8-format run holds each FP8 gemm's amax history and scales; converting
    it to TP2 was refused ('the source has tensors the model has no place for: ...gemm.amax_history').
    They are layout-free (amaxes are reduced over TP), so every TP rank gets them whole, and the TP2
    resume follows the unconverted TP1 resume within FP8's parallel tolerance (test_fp8.py); a resume
    that restarted the scales at 1 would quantise its first steps differently."""
    from tests.e2e.test_fp8 import FP8, GRAD_RTOL

    fp8 = FP8 + ["--fp8-amax-history-len", "4", "--fp8-amax-compute-algo", "max"]
    src, tp2 = str(tmp_path / "src"), str(tmp_path / "tp2")
    pretrain_gpt.main(_argv(src, 8, fp8 + ["--exit-interval", "4"]))
    assert load_tool("checkpoint/convert").main(["--model-type", "GPT", "--load-dir", src, "--save-dir", tp2,
                                                 "--target-tensor-parallel-size", "2"]) == 0
    want, _ = merge_checkpoint(src)
    scales = {k: v for k, v in want.items() if k.endswith((".gemm.scale", ".gemm.amax_history"))}
    assert len(scales) == 2 * 16 and not any(torch.equal(v, torch.ones(3)) for k, v in scales.items() if "scale" in k)
    for rank in ("mp_rank_00_000", "mp_rank_01_000"):
        got = torch.load(os.path.join(tp2, "iter_0000004", rank, "model_optim_rng.pt"), weights_only=True)["model"][0]
        assert all(torch.equal(got[k], v) for k, v in scales.items())
    original = pretrain_gpt.main(_argv(str(tmp_path / "a"), 8, fp8 + ["--load", src] + RESUME))
    converted = ranks_trajectory(2, "pretrain_gpt", _argv(str(tmp_path / "b"), 8, fp8 + [
        "--load", tp2, "--tensor-model-parallel-size", "2"] + RESUME))
    assert_same_trajectory(converted, Trajectory.of(original), rtol=1e-3, grad_rtol=GRAD_RTOL, steps=4,
                           what="FP8 converted to TP2")
