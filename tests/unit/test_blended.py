"""Blending order against a direct transcription of the rule, shares at every prefix, caching."""

import numpy as np
import pytest

from megatron_lite.data.blended import (
    BlendedDataset,
    build_blending_indices,
    normalize_weights,
    samples_per_dataset,
)


def reference_blend(weights, size):
    """At each sample pick argmax_d weights[d] * max(i, 1) - count[d] (first d on ties)."""
    counts = np.zeros(len(weights), dtype=np.int64)
    which, rank = [], []
    for i in range(size):
        errors = [float(weights[d]) * max(i, 1.0) - float(counts[d]) for d in range(len(weights))]
        best = int(np.argmax(errors))  # np.argmax returns the first maximum
        which.append(best)
        rank.append(counts[best])
        counts[best] += 1
    return np.array(which), np.array(rank)


@pytest.mark.parametrize("weights", [[1.0], [0.5, 0.5], [0.3, 0.7], [0.2, 0.5, 0.3],
                                     [0.05, 0.15, 0.1, 0.4, 0.3], [1, 2, 3, 4, 5, 6, 7]])
def test_blending_equals_reference(weights):
    w = normalize_weights(weights)
    which, rank = build_blending_indices(w, 3000)
    ref_which, ref_rank = reference_blend(w, 3000)
    np.testing.assert_array_equal(which, ref_which)
    np.testing.assert_array_equal(rank, ref_rank)


def test_shares_track_weights_at_every_prefix():
    rng = np.random.default_rng(0)
    for _ in range(5):
        w = normalize_weights(rng.random(int(rng.integers(2, 8))) + 0.01)
        which, rank = build_blending_indices(w, 20_000)
        counts = np.cumsum(np.eye(len(w), dtype=np.int64)[which], axis=0)  # counts after each sample
        n = np.arange(1, len(which) + 1)[:, None]
        # Shares within 1% (absolute) after 1,000 samples ...
        assert np.abs(counts[999:] / n[999:] - w).max() < 0.01
        # ... and counts within 2 samples of weight * n at every prefix.
        assert np.abs(counts - w * n).max() < 2.0
        # Each dataset is read in order 0, 1, 2, ...
        for d in range(len(w)):
            np.testing.assert_array_equal(rank[which == d], np.arange((which == d).sum()))


class _Numbers:
    """A stand-in dataset: sample j is {"x": j}; has a description so the blend can be cached."""

    def __init__(self, n, name):
        self.n, self.description = n, {"name": name, "n": n}

    def __len__(self):
        return self.n

    def __getitem__(self, j):
        assert 0 <= j < self.n
        return {"x": np.int64(j)}


def test_blended_dataset_items_sizes_and_cache(tmp_path):
    weights, total = [2.0, 1.0, 1.0], 1000
    sizes = samples_per_dataset(normalize_weights(weights), total)
    assert sizes == [int(np.ceil(w * total * 1.005)) for w in (0.5, 0.25, 0.25)]
    parts = [_Numbers(n, f"d{i}") for i, n in enumerate(sizes)]
    blend = BlendedDataset(parts, weights, total, cache_dir=str(tmp_path))
    assert blend.index_source == "built" and len(blend) == total
    seen = {d: [] for d in range(3)}
    for i in range(total):
        item = blend[i]
        seen[int(item["dataset_id"])].append(int(item["x"]))
    for d in range(3):
        assert seen[d] == list(range(len(seen[d])))
    again = BlendedDataset(parts, weights, total, cache_dir=str(tmp_path))
    assert again.index_source == "loaded"
    np.testing.assert_array_equal(again.dataset_index, blend.dataset_index)
    with pytest.raises(ValueError, match="has 10 samples"):
        BlendedDataset([_Numbers(10, "a"), _Numbers(1000, "b")], [0.5, 0.5], 1000)


def test_bad_weights_are_rejected():
    for bad in ([-1, 2], [0, 0], [float("nan"), 1]):
        with pytest.raises(ValueError, match="non-negative"):
            normalize_weights(bad)


@pytest.mark.parametrize("weights", [[0, 1, 3], [0, 0.5, 0.5], [1, 0, 1, 2], [0, 1, 0, 1, 2], [2, 1, 0]])
def test_a_weight_0_dataset_is_never_drawn_and_the_others_keep_their_order(weights):
    """Megatron's rule draws a weight-0 dataset on an exact tie of every error at 0 ([0, 1, 3]: dataset 0
    at sample 4); here it is never drawn, and the others come in the order of the blend without it."""
    which, rank = build_blending_indices(normalize_weights(weights), 2000)
    live = [d for d, w in enumerate(weights) if w > 0]
    ref_which, ref_rank = build_blending_indices(normalize_weights([weights[d] for d in live]), 2000)
    np.testing.assert_array_equal(which, np.asarray(live)[ref_which])
    np.testing.assert_array_equal(rank, ref_rank)
