"""Dropout that keeps a one-byte mask on the CPU, drawn in parallel chunks from SFC64 generators.

On the CPU, ``F.dropout`` draws with the Bernoulli kernel (about 3x slower per element than a
uniform draw on a 2-core AMD EPYC) and keeps its mask for backward in the activation's dtype.
:func:`dropout` keeps a one-byte mask instead (as Korthikanti et al. count it), drawn by
:func:`keep_mask`. PyTorch's CPU generator (a Mersenne Twister) is serial and costs about 6 ns per
64-bit word here, so the mask's bits come from NumPy's SFC64 generator instead (about 3 ns per word,
and its raw draws release the GIL). The mask is cut into chunks of ``CHUNK_WORDS`` 64-bit words; for
chunk ``k`` three 64-bit words ``a, b, c`` are drawn from PyTorch's current CPU generator (one call
for all chunks), and the chunk's words are the raw outputs of SFC64 started at the state
``(a, b, c, counter 1)``: a random state of the generator, so the chunks are independent streams. The
chunks are shared among ``torch.get_num_threads()`` threads, each compared with the threshold while
still in the cache. Which mask is drawn depends on PyTorch's generator and the chunk size, never on
the thread count; on a 2-core AMD EPYC a training step's masks are drawn about 2x faster than from
the Mersenne Twister (``benchmarks/bench_dropout_mask.py``), and a tiny mask costs about the same.
Each 64-bit word is read as four 16-bit lanes (two 32-bit lanes when ``p < 1/128``); an entry is
kept when its lane, a signed integer, is at least ``round(p * 2^bits) - 2^(bits - 1)``, so it is
dropped with probability ``round(p * 2^16) / 2^16`` (with 32-bit lanes ``round(p * 2^32) / 2^32``): p
to within 2^-17, at most 0.1% of p. The output is ``x * keep / (1 - p)``; multiplying by the 0/1
bytes is one vectorised pass (``torch.where`` on a boolean mask is an element-by-element loop on the
CPU, 2-3x slower), and its backward keeps only the mask. On other devices it is ``F.dropout`` (one
fused kernel there). Either way the mask follows from the current generator's state: set the seed
(or restore the state, as activation recomputation and the tensor-parallel generator tracker do)
and the same mask is drawn again.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.nn.functional as F

SHORT_LANES_MIN_P = 1 / 128  # from here up 16-bit lanes hold p to within 0.1% of itself
CHUNK_WORDS = 2**18  # 64-bit words per independently seeded chunk (2 MiB: one chunk stays in L2)

_pool: tuple[int, int, ThreadPoolExecutor] | None = None  # (pid, threads, pool): a forked child makes its own
_local = threading.local()  # each thread's SFC64, restarted at every chunk's state


def lane_bits(p: float) -> int:
    """Bits of random integer per mask entry that :func:`keep_mask` draws for probability ``p``."""
    return 16 if p >= SHORT_LANES_MIN_P else 32


def _threads() -> ThreadPoolExecutor | None:
    """The pool that draws the chunks (``torch.get_num_threads()`` threads); None for one thread."""
    global _pool
    threads = torch.get_num_threads()
    if threads < 2:
        return None
    if _pool is None or _pool[:2] != (os.getpid(), threads):
        if _pool is not None and _pool[0] == os.getpid():  # another thread count: let the old pool's threads go
            _pool[2].shutdown(wait=False)
        _pool = (os.getpid(), threads, ThreadPoolExecutor(threads, thread_name_prefix="keep_mask"))
    return _pool[2]


def draw_lanes(state: np.ndarray, words: int, bits: int) -> np.ndarray:
    """``words`` raw outputs of SFC64 from ``state`` (its ``a, b, c`` words; counter 1), as signed
    ``bits``-bit lanes."""
    gen = getattr(_local, "sfc64", None)
    if gen is None:
        gen = _local.sfc64 = np.random.SFC64(0)
    gen.state = {"bit_generator": "SFC64", "state": {"state": np.append(state, np.uint64(1))},
                 "has_uint32": 0, "uinteger": 0}
    return gen.random_raw(words).view(np.int16 if bits == 16 else np.int32)


@torch._disable_dynamo  # torch.compiler.disable, Dynamo imported at the first call (not at start-up: ~1.2 s)
# Dynamo cannot trace the NumPy draw; in a compiled region this is one clean break
def keep_mask(shape, p: float) -> torch.Tensor:
    """A ``uint8`` CPU tensor of ``shape``: 0 (dropped) with probability ``p``, else 1, drawn in chunks
    of SFC64 lanes started at states from the current CPU generator (module docstring)."""
    bits = lane_bits(p)
    lanes = 2**bits
    threshold = round(p * lanes) - lanes // 2  # a lane is uniform over [-lanes / 2, lanes / 2)
    keep = torch.empty(shape, dtype=torch.uint8)
    if threshold >= lanes // 2:
        return keep.zero_()
    n = keep.numel()
    per_chunk = CHUNK_WORDS * (64 // bits)
    chunks = range(-(-n // per_chunk))
    states = torch.empty((len(chunks), 3), dtype=torch.int64).random_(-(2**63), None).numpy().view(np.uint64)
    flat = keep.numpy().reshape(-1).view(np.bool_)

    def fill(chunk: int) -> None:
        lo = chunk * per_chunk
        hi = min(n, lo + per_chunk)
        lane = draw_lanes(states[chunk], -(-(hi - lo) * bits // 64), bits)
        np.greater_equal(lane[: hi - lo], threshold, out=flat[lo:hi])

    pool = _threads() if len(chunks) > 1 else None
    for _ in pool.map(fill, chunks) if pool is not None else map(fill, chunks):
        pass
    return keep


def dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """``F.dropout(x, p, training)``; on the CPU with a one-byte :func:`keep_mask`."""
    if not training or p == 0:
        return x
    if x.device.type != "cpu" or p >= 1:
        return F.dropout(x, p, True)
    return torch.mul(x, keep_mask(x.shape, p)).mul_(1.0 / (1.0 - p))  # backward saves the mask only
