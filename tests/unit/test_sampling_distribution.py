"""Sampling draws from the distribution docs/inference.md states: softmax(logits / temperature), over
the top-k tokens or the top-p nucleus renormalised (megatron_lite/inference/sampling.py). Many draws
from a small vocabulary with a fixed seed are compared with the exact probabilities (computed here in
float64, independently of the sampler) by Pearson's chi-square test at p = 1e-6: with a fixed seed
the test cannot flake, and a correct sampler would fail it for one seed in a million. Each case also
checks the test has the power to see a wrong sampler: the same counts against the distribution a
sampler ignoring the temperature (or not renormalising) would give are rejected by a wide margin."""

import math

import pytest
import torch

from megatron_lite.inference.sampling import SamplingParams, sample

LOGITS = [2.0, 1.2, 0.5, 0.0, -0.3, -1.0, 1.7, 0.9]  # no ties: top-k and top-p keep a definite set
DRAWS = 40_000
# chi-square critical values at p = 1e-6 by degrees of freedom (scipy.stats.chi2.isf(1e-6, df))
CRITICAL = {1: 23.93, 2: 27.63, 3: 30.66, 4: 33.38, 5: 35.89, 6: 38.26, 7: 40.52}


def _softmax(values: list[float], temperature: float) -> list[float]:
    top = max(values)
    weights = [math.exp((v - top) / temperature) for v in values]
    return [w / sum(weights) for w in weights]


def _exact(temperature: float, top_k: int = 0, top_p: float = 0.0) -> list[float]:
    """The probability of each token under the stated rule (float64, written out)."""
    probs = _softmax(LOGITS, temperature)
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    if top_k:
        kept = set(order[:top_k])
    elif top_p:
        kept, total = set(), 0.0
        for i in order:  # the most likely tokens until their probability reaches top_p (that one kept)
            kept.add(i)
            total += probs[i]
            if total >= top_p:
                break
    else:
        kept = set(order)
    mass = sum(probs[i] for i in kept)
    return [probs[i] / mass if i in kept else 0.0 for i in range(len(probs))]


def _chi_square(counts: list[int], expected: list[float]) -> tuple[float, int]:
    """Pearson's statistic over the tokens of non-zero probability, and its degrees of freedom."""
    cells = [(c, DRAWS * p) for c, p in zip(counts, expected, strict=True) if p > 0]
    return sum((c - e) ** 2 / e for c, e in cells), len(cells) - 1


def _counts(params: SamplingParams, seed: int = 1234) -> list[int]:
    params.check()
    logits = torch.tensor(LOGITS).expand(DRAWS, -1).contiguous()  # one row per draw: one call
    tokens = sample(logits, params, torch.Generator().manual_seed(seed))
    return torch.bincount(tokens, minlength=len(LOGITS)).tolist()


CASES = {  # name: (params, the distribution of a wrong sampler the counts must reject)
    "T 0.5": (SamplingParams(temperature=0.5), _exact(1.0)),
    "T 1": (SamplingParams(temperature=1.0), _exact(0.8)),
    "T 1.7": (SamplingParams(temperature=1.7), _exact(1.0)),
    "T 0.8 top-k 3": (SamplingParams(temperature=0.8, top_k=3), _exact(1.0, top_k=3)),
    "T 1.3 top-k 5": (SamplingParams(temperature=1.3, top_k=5), _exact(1.3)),  # top-k not applied
    "T 1.3 top-p 0.7": (SamplingParams(temperature=1.3, top_p=0.7), _exact(1.0, top_p=0.7)),
    "T 0.6 top-p 0.9": (SamplingParams(temperature=0.6, top_p=0.9), _exact(0.6, top_k=2)),  # the crossing token dropped
}


@pytest.mark.parametrize("name", list(CASES))
def test_draws_follow_the_stated_distribution(name):
    params, wrong = CASES[name]
    expected = _exact(params.temperature, params.top_k, params.top_p)
    counts = _counts(params)
    assert all(c == 0 for c, p in zip(counts, expected, strict=True) if p == 0), (counts, expected)  # filtered: never
    stat, df = _chi_square(counts, expected)
    assert df >= 1 and stat < CRITICAL[df], f"{name}: chi-square {stat:.1f} over {df} dof, counts {counts}"
    # the test sees a wrong sampler: its distribution is rejected (unseen tokens count as a rejection)
    if any(c > 0 for c, p in zip(counts, wrong, strict=True) if p == 0):
        return
    stat, df = _chi_square(counts, wrong)
    assert stat > 5 * CRITICAL[df], f"{name}: the wrong distribution is not rejected ({stat:.1f})"
