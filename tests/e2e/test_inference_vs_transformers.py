"""Our engine against Hugging Face ``transformers`` on checkpoints exported with tools/checkpoint/convert.py,
and our lm-eval backend against lm-eval's own ``hf`` backend.

* GPT-2 (learned positions, LayerNorm, GeLU, biases, tied) and Llama-style (rotary, RMSNorm, SwiGLU,
  grouped-query attention, untied) models with random weights: our greedy continuation equals
  ``generate``'s token for token and our log-probs of every prompt and generated token equal the
  log-softmax of ``transformers``' logits within 1e-4.
* lm-eval over the YAML tasks in tests/fixtures/lm_eval (multiple choice, perplexity, generation) on a
  GPT-2-vocabulary model: every metric through ``--model megatron_lite`` on our checkpoint equals the
  ``hf`` backend's on the exported one within 1e-4, and so do the per-request log-likelihoods and
  the generated texts.
"""

import os

import pytest
import torch

from megatron_lite.inference.engine import InferenceEngine
from megatron_lite.inference.loading import load_model
from megatron_lite.inference.sampling import SamplingParams
from tests.convert_helpers import convert
from tests.inference_helpers import GPT2_TOKENIZER, MAX_LEN, VOCAB, prompts, save_model

transformers = pytest.importorskip("transformers")
NEW = 24
FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "lm_eval")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """{variant: (our checkpoint, exported Hugging Face folder)}."""
    root = tmp_path_factory.mktemp("vs_hf")
    out = {}
    for variant in ("gpt", "rope_gqa"):
        ckpt, hf = str(root / variant), str(root / f"{variant}_hf")
        save_model(variant, ckpt)
        assert convert("GPT", "--saver", "hf", "--load-dir", ckpt, "--save-dir", hf) == 0
        out[variant] = (ckpt, hf)
    return out


@pytest.mark.parametrize("variant, hf_class", [("gpt", "GPT2LMHeadModel"), ("rope_gqa", "LlamaForCausalLM")])
def test_greedy_continuation_and_log_probs_equal_transformers(variant, hf_class, exported):
    ckpt, hf_dir = exported[variant]
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert type(hf).__name__ == hf_class
    model, _ = load_model(ckpt)
    engine = InferenceEngine(model, vocab_size=VOCAB, max_sequence_length=MAX_LEN)
    batch = prompts(3)
    ours = engine.generate(batch, SamplingParams(tokens_to_generate=NEW, top_k=1, stop_on_eod=False))
    for prompt, got in zip(batch, ours):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                                 do_sample=False, pad_token_id=0)
            logp = hf(torch.tensor([got.tokens])).logits[0, :-1].float().log_softmax(-1)
        assert got.tokens == theirs[0].tolist()
        want = logp.gather(-1, torch.tensor(got.tokens[1:]).unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(torch.tensor(got.log_probs), want, rtol=0, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# lm-evaluation-harness


def _lm_eval(model, model_args):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    import megatron_lite.inference.lm_eval_backend  # noqa: F401 - registers "megatron_lite"

    return simple_evaluate(model=model, model_args=model_args, tasks=["tiny_mc", "tiny_text", "tiny_gen"],
                           task_manager=TaskManager(include_path=FIXTURES, include_defaults=False), batch_size=4, device="cpu", log_samples=True,
                           random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)


def _sample_values(samples):
    """Per task, the requests' raw results in document order (log-likelihoods, or generated texts)."""
    out = {}
    for task, rows in samples.items():
        rows = sorted(rows, key=lambda r: r["doc_id"])
        out[task] = [r["resps"] for r in rows]
    return out


def test_lm_eval_backend_matches_the_hf_backend(tmp_path, monkeypatch):
    pytest.importorskip("lm_eval")
    pytest.importorskip("accelerate")  # lm-eval's hf backend (lm-eval[hf])
    monkeypatch.chdir(FIXTURES)  # the tasks' data_files are relative to their folder
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ckpt, hf_dir = str(tmp_path / "gpt2"), str(tmp_path / "gpt2_hf")
    save_model("gpt", ckpt, tokenizer=GPT2_TOKENIZER)
    assert convert("GPT", "--saver", "hf", "--load-dir", ckpt, "--save-dir", hf_dir) == 0
    ours = _lm_eval("megatron_lite", f"load={ckpt}")
    theirs = _lm_eval("hf", f"pretrained={hf_dir},dtype=float32")
    for task, metrics in theirs["results"].items():
        for name, value in metrics.items():
            if isinstance(value, float):
                assert ours["results"][task][name] == pytest.approx(value, rel=1e-4, abs=1e-4), f"{task} {name}"
    assert {"tiny_mc", "tiny_text", "tiny_gen"} <= set(ours["results"])
    got, want = _sample_values(ours["samples"]), _sample_values(theirs["samples"])
    for task in want:
        for a, b in zip(got[task], want[task], strict=True):
            if task == "tiny_gen":
                assert a == b
            else:  # [[(loglikelihood, is_greedy)], ...] or [[loglikelihood]]
                flat_a, flat_b = torch.tensor(_numbers(a)), torch.tensor(_numbers(b))
                torch.testing.assert_close(flat_a, flat_b, rtol=1e-4, atol=1e-4)


def _numbers(resps):
    out = []
    for r in resps:
        for x in (r if isinstance(r, (list, tuple)) else [r]):
            for y in (x if isinstance(x, (list, tuple)) else [x]):
                out.append(float(y))
    return out


def test_run_lm_eval_runs_lm_eval_with_the_backend_registered(monkeypatch):
    pytest.importorskip("lm_eval")
    pytest.importorskip("accelerate")
    import lm_eval.__main__
    from lm_eval.api.registry import get_model

    from tests.tools import load_tool

    seen = []
    monkeypatch.setattr(lm_eval.__main__.HarnessCLI, "execute", lambda self, args: seen.append(
        (get_model("megatron_lite"), get_model("hf"), args.model)))
    load_tool("run_lm_eval").main(["--model", "megatron_lite", "--model_args", "load=x", "--tasks", "t"])
    assert [cls.__name__ for cls in seen[0][:2]] == ["MegatronLiteLM", "HFLM"]
    assert seen[0][2] == "megatron_lite"  # lm-eval's own arguments (its legacy form: 'run' inserted)
