"""fusions.dropout.dropout on the CPU: F.dropout's function (kept entries scaled by 1 / (1 - p), the
rest zero, about p dropped, gradient through the same mask), a one-byte mask (1 byte per element
saved for backward), identity when not training or p = 0, zeros at p = 1, and reproducible from the
generator state. keep_mask (the CPU's draw: chunks of SFC64 words, each chunk started at a state
drawn from the generator, four 16-bit lanes per 64-bit word, two 32-bit lanes for p < 1/128) is the
documented draw whatever the thread count, and drops each entry with probability p, in every lane
and every chunk, with no correlation between neighbours."""

import math

import numpy as np
import pytest
import torch

from megatron_lite.fusions.dropout import CHUNK_WORDS, dropout, keep_mask, lane_bits
from megatron_lite.perf.activation_memory import saved_activation_bytes


def test_scales_what_it_keeps_and_drops_about_p():
    x = torch.rand(256, 1024) + 0.5  # no zeros of its own
    torch.manual_seed(0)
    y = dropout(x, 0.2)
    kept = y != 0
    torch.testing.assert_close(y[kept], x[kept] / 0.8)
    assert abs(kept.float().mean().item() - 0.8) < 3e-3  # 262144 draws: the standard error is 8e-4


def test_gradient_uses_the_same_mask():
    x = torch.randn(64, 32, requires_grad=True)
    torch.manual_seed(1)
    y = dropout(x, 0.3)
    y.backward(torch.ones_like(y))
    torch.testing.assert_close(x.grad, (y != 0).float() / 0.7)


def test_saves_one_byte_per_element():
    layer = torch.nn.Identity()
    layer.forward = lambda x: dropout(x, 0.1)
    x = torch.randn(128, 64, dtype=torch.bfloat16, requires_grad=True)
    assert saved_activation_bytes(layer, x) == 128 * 64  # the one-byte keep mask only


def test_identity_zeros_and_reproducibility():
    x = torch.randn(8, 8)
    assert dropout(x, 0.5, training=False) is x and dropout(x, 0.0) is x
    assert torch.equal(dropout(x, 1.0), torch.zeros_like(x))
    torch.manual_seed(3)
    a = dropout(x, 0.5)
    torch.manual_seed(3)
    assert torch.equal(a, dropout(x, 0.5))


def _expected_keep(shape, p, seed):
    """The documented draw, written out serially: for each chunk of CHUNK_WORDS 64-bit words, three
    words (a, b, c) from the generator, all drawn at once; the chunk is SFC64's raw output from the
    state (a, b, c, counter 1); each word read as ``lane_bits(p)``-bit lanes, an entry kept when its
    lane is at least ``round(p * 2^bits) - 2^(bits - 1)``."""
    bits = lane_bits(p)
    n = math.prod(shape)
    chunks = -(-n * bits // (64 * CHUNK_WORDS))
    torch.manual_seed(seed)
    states = torch.empty((chunks, 3), dtype=torch.int64).random_(-(2**63), None).numpy().view(np.uint64)
    words = []
    for a, b, c in states:
        sfc = np.random.SFC64()
        sfc.state = {"bit_generator": "SFC64", "state": {"state": np.array([a, b, c, 1], dtype=np.uint64)},
                     "has_uint32": 0, "uinteger": 0}
        words.append(sfc.random_raw(CHUNK_WORDS))
    lanes = torch.from_numpy(np.concatenate(words).view(np.int16 if bits == 16 else np.int32)[:n]).long()
    return (lanes >= round(p * 2**bits) - 2 ** (bits - 1)).view(shape)


@pytest.mark.parametrize("p", [0.1, 1 / 128, 1 / 128 - 1e-9, 1e-3, 0.77])
def test_keep_mask_is_the_documented_draw_on_any_thread_count(p):
    shape = (1999, 1001)  # 2 M entries: 2 chunks of 16-bit lanes (the last part-used), 4 of 32-bit ones
    expected = _expected_keep(shape, p, 5)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            torch.manual_seed(5)
            keep = keep_mask(shape, p)
            assert keep.dtype == torch.uint8 and keep.shape == shape and set(keep.unique().tolist()) <= {0, 1}
            assert torch.equal(keep.bool(), expected), n
    finally:
        torch.set_num_threads(threads)
    assert lane_bits(p) == (16 if p >= 1 / 128 else 32)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 0.005])
def test_keep_mask_drops_p_in_every_lane_independently(p):
    torch.manual_seed(7)
    keep = keep_mask((1999, 1001), p).float()  # 2 chunks (4 with 32-bit lanes), the last word part-used
    flat = keep.flatten()
    per_word = 64 // lane_bits(p)  # 16-bit lanes: 4 entries per 64-bit word; 32-bit: 2
    se = (p * (1 - p) / (flat.numel() / per_word)) ** 0.5  # standard error of a rate over one lane's draws
    for lane in range(per_word):
        assert abs(flat[lane::per_word].mean().item() - (1 - p)) < 5 * se, lane
    per_chunk = CHUNK_WORDS * per_word
    chunks = flat[: flat.numel() // per_chunk * per_chunk].view(-1, per_chunk)
    for k, chunk in enumerate(chunks):  # every chunk its own stream: same rate, no chunk repeating the first
        assert abs(chunk.mean().item() - (1 - p)) < 5 * (p * (1 - p) / per_chunk) ** 0.5, k
        assert k == 0 or not torch.equal(chunk, chunks[0])
    a, b = flat[:-1] - flat.mean(), flat[1:] - flat.mean()
    assert abs((a * b).mean().item() / (a * a).mean().item()) < 0.01  # neighbours uncorrelated


def test_keep_mask_edges_and_reproducibility():
    assert keep_mask((5, 3), 1e-12).all()  # p below 2^-33 rounds to keeping everything
    assert not keep_mask((5, 3), 1 - 1e-12).any()  # and just below 1 to dropping everything
    torch.manual_seed(11)
    a = keep_mask((64, 33), 0.3)
    torch.manual_seed(11)
    assert torch.equal(a, keep_mask((64, 33), 0.3))
    assert not torch.equal(a, keep_mask((64, 33), 0.3))  # the generator moved on
