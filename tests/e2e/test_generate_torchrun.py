"""tools/generate.py under torchrun runs at the checkpoint's saved layout (here TP2, no layout flags)
and prints what one process prints: the same tokens of a seeded top-k sample and the same
log-probs (printed with 4 decimals: within 2e-4)."""

import os
import subprocess
import sys

from megatron_lite.checkpoint.reshard import TargetLayout, load_megatron, save_megatron
from tests.e2e.conftest import ROOT
from tests.harness import free_port
from tests.inference_helpers import prompts, save_model
from tests.tools import load_tool


def _parse(out: str):
    """(texts, [(token, log-prob)]) of generate.py's output."""
    texts = [line for line in out.splitlines() if line and not line.startswith("  ")]
    scored = [(int(line.split()[0]), float(line.split()[1])) for line in out.splitlines() if line.startswith("  ")]
    return texts, scored


def test_generate_under_torchrun_at_the_saved_layout_equals_one_process(tmp_path, capsys):
    one, tp2 = str(tmp_path / "one"), str(tmp_path / "tp2")
    save_model("rope_gqa", one)
    save_megatron(load_megatron(one), tp2, TargetLayout(tp=2, pp=1))
    capsys.readouterr()  # the saver's report
    argv = ["--load", tp2, "--top-k", "4", "--seed", "3", "--max-new-tokens", "8", "--log-probs"]
    for p in prompts(2):
        argv += ["--prompt", " ".join(map(str, p))]
    assert load_tool("generate").main(argv) == 0
    want = _parse(capsys.readouterr().out)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "tools/generate.py", *argv]
    env = dict(os.environ, OMP_NUM_THREADS="1", MEGATRON_LITE_DEVICE="cpu")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = _parse(proc.stdout)
    assert got[0] == want[0] and len(want[0]) == 2
    assert [t for t, _ in got[1]] == [t for t, _ in want[1]]
    assert all(abs(a - b) <= 2e-4 for (_, a), (_, b) in zip(got[1], want[1]))


def test_speculative_decoding_at_tp2_equals_one_process_and_every_rank_decides_alike(tmp_path):
    """tests/e2e/specdec_ranks.py (MLA + 1 MTP depth, an oracle drafter wrong every third draft): at TP2,
    through the server's batching runner, the greedy requests (with drafts, the two-prompt one as one
    speculative batch) give the one-process engine's tokens and log-probs (within 1e-5), and both
    ranks ran the same rounds and drew the same seeded sample (the same results, the same acceptance)."""
    import torch

    from megatron_lite.inference.engine import InferenceEngine
    from megatron_lite.inference.loading import load_model
    from tests.e2e import specdec_ranks
    from tests.harness import run_ranks
    from tests.inference_helpers import MAX_LEN, VOCAB, assert_close

    root = str(tmp_path / "mla_mtp")
    save_model("mla_mtp", root)
    ranks = run_ranks(2, specdec_ranks.speculative_answers, root)
    model, _ = load_model(root)
    plain = InferenceEngine(model, vocab_size=VOCAB, max_sequence_length=MAX_LEN, eod=VOCAB - 1)
    answers = ranks[0]["answers"]
    for i in specdec_ranks.GREEDY:
        want = plain.generate(*specdec_ranks.REQUESTS[i])
        assert [a["tokens"] for a in answers[i]] == [w.tokens for w in want], i
        for a, w in zip(answers[i], want):
            assert_close(torch.tensor(a["log_probs"]), torch.tensor(w.log_probs), what=f"request {i}")
    rounds = [{k: v for k, v in rank["served"].items() if k != "fell_back"} for rank in ranks]
    assert ranks[0]["drafted"] == ranks[1]["drafted"] and rounds[0] == rounds[1]
    assert [d["tokens"] for d in ranks[0]["drafted"]] == [a["tokens"] for answer in answers for a in answer]
    served = ranks[0]["served"]  # every request ran with drafts, the two-prompt one as a batch
    assert served["requests"] == 4 and served["fell_back"] == 0 and 0 < served["accepted"] < served["drafted"], served
