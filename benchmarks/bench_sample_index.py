"""Time the index builds of the data pipeline at Megatron scale.

    python benchmarks/bench_sample_index.py [--documents 10000000] [--blend-samples 10000000]

1. GPT sample index (vectorised numpy) for 10 M documents of 50-2000 tokens, seq 2048, 1 epoch:
   the same work as megatron-core's C++ ``build_sample_idx``, timed the same way: around the call,
   document index given. Peer figure (not measured here, megatron-core is not a dependency):
   megatron-core 0.16's pybind11 ``build_sample_idx`` took 0.28 s for these sizes, timed around the
   call on the project's CPU machine class (2 cores, 24 GiB, PyTorch 2.13.0 CPU); figure recorded
   for the project by 2026-11-21, exact measurement date not recorded.
2. The whole GPT index (document shuffle + sample index + sample shuffle) for context.
3. The blending index for 10 M samples over 3 datasets (pure Python loop of Megatron's rule).
Best of --repeats runs; the ratio column is our time / the C++ helper's time (< 1 is faster), printed
only at the sizes that figure was measured at (the defaults: --documents 10000000 --seq-length 2048).
"""

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import OneLineParser, describe_machine, positive_int  # noqa: E402
from megatron_lite.data.blended import build_blending_indices  # noqa: E402
from megatron_lite.data.gpt_dataset import build_gpt_indices, build_sample_index  # noqa: E402

CPP_SAMPLE_INDEX_SECONDS = 0.28  # megatron-core 0.16 build_sample_idx, same sizes, this machine class
CPP_SIZES = (10_000_000, 2048)  # (documents, seq length) of that figure


def best_time(fn, repeats):
    best, result = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def cpp_comparison(seconds: float, documents: int, seq_length: int) -> str:
    """Our time against the C++ helper's recorded figure, which holds only at its own sizes."""
    if (documents, seq_length) != CPP_SIZES:
        return (f"C++ helper {CPP_SAMPLE_INDEX_SECONDS:.2f} s was measured at {CPP_SIZES[0]:,} docs, seq "
                f"{CPP_SIZES[1]}: no ratio at these sizes")
    return f"C++ helper {CPP_SAMPLE_INDEX_SECONDS:.2f} s | ratio {seconds / CPP_SAMPLE_INDEX_SECONDS:.2f}"


def main(argv=None):
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--documents", type=positive_int, default=10_000_000)
    ap.add_argument("--seq-length", type=positive_int, default=2048)
    ap.add_argument("--blend-samples", type=positive_int, default=10_000_000)
    ap.add_argument("--repeats", type=positive_int, default=5)
    args = ap.parse_args(argv)

    print(describe_machine())
    print(f"numpy {np.__version__}")
    rng = np.random.default_rng(0)
    sizes = rng.integers(50, 2001, args.documents).astype(np.int32)
    document_index = np.random.RandomState(1234).permutation(args.documents).astype(np.int32)

    t, sample_index = best_time(lambda: build_sample_index(sizes, document_index, args.seq_length), args.repeats)
    n = sample_index.shape[0] - 1
    assert n == (int(sizes.sum(dtype=np.int64)) - 1) // args.seq_length
    assert sample_index[:, 1].min() >= 0 and np.all(sample_index[1:, 1] < sizes[document_index[sample_index[1:, 0]]])
    print(f"GPT sample index, {args.documents:,} docs, seq {args.seq_length}, 1 epoch ({n:,} samples): "
          f"{t:.3f} s | {cpp_comparison(t, args.documents, args.seq_length)}")

    t_all, _ = best_time(lambda: build_gpt_indices(sizes, np.arange(args.documents), None, args.seq_length, 1234), 1)
    print(f"GPT all three indices (incl. RandomState shuffles of documents and samples): {t_all:.3f} s")

    weights = np.array([0.5, 0.3, 0.2])
    t_blend, (which, _) = best_time(lambda: build_blending_indices(weights, args.blend_samples), 1)
    share = np.bincount(which, minlength=3) / len(which)
    print(f"blending index, {args.blend_samples:,} samples over 3 datasets: {t_blend:.2f} s "
          f"({t_blend / args.blend_samples * 1e9:.0f} ns/sample), shares {np.round(share, 4).tolist()}")


if __name__ == "__main__":
    main()
