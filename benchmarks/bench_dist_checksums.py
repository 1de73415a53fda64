"""What the torch_dist checksums cost: save and load time of a small GPT with and without them.

One process on CPU, fp32, Adam (weights + both moments are saved). Each round saves a checkpoint
twice, once as usual and once with the CRC-32s left out (``tensor_crc`` replaced by a constant on
the save side), then loads each: the first verifies every piece, the second has its ``checksums/``
folder removed (how a checkpoint saved before checksums reads: unverified). Timed: the pieces'
write (``dist_save.write_pieces``, CRC-32s included) and the pieces' read (``dist_read.load_keys``,
verification included); training, the small files and process start are left out. Best of the rounds.
Also the CRC-32 alone over as many bytes (what the overhead should be, whatever else shares the cores).

    python benchmarks/bench_dist_checksums.py [--rounds 3] [--hidden 384] [--layers 6]
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

os.environ.setdefault("MEGATRON_LITE_DEVICE", "cpu")

import torch  # noqa: E402

import megatron_lite.checkpoint.dist_read as dist_read  # noqa: E402
import megatron_lite.checkpoint.dist_save as dist_save  # noqa: E402
import pretrain_gpt  # noqa: E402
from benchmarks.common import OneLineParser, describe_machine, positive_int  # noqa: E402
from megatron_lite.checkpoint.format import atomic_save, with_checksums  # noqa: E402


def model_args(hidden: int, layers: int) -> list[str]:
    return ["--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", "8",
            "--seq-length", "64", "--max-position-embeddings", "64", "--vocab-size", "16384", "--mock-data",
            "--micro-batch-size", "1", "--global-batch-size", "1", "--lr", "1e-4", "--eval-iters", "0",
            "--log-interval", "100", "--ckpt-format", "torch_dist", "--train-iters", "1"]


class Timed:
    """Wraps ``module.name`` and sums the seconds spent in it."""

    def __init__(self, module, name):
        self.module, self.name, self.seconds = module, name, 0.0
        self.inner = getattr(module, name)

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start

    def __enter__(self):
        setattr(self.module, self.name, self)
        return self

    def __exit__(self, *exc):
        setattr(self.module, self.name, self.inner)


def as_saved_before_checksums(folder: str) -> None:
    """Make a checkpoint saved with the CRC-32s left out read as one saved before checksums existed:
    no ``checksums/`` folder, and no marker in ``common.pt`` (with the marker and without the folder
    the load refuses it as a copy that lost its checksums)."""
    shutil.rmtree(os.path.join(folder, dist_read.DIST_CHECKSUMS_DIR))
    common = dist_read.read_common(folder)
    del common[dist_read.PIECE_CHECKSUMS_MARK]
    atomic_save(with_checksums(common), os.path.join(folder, dist_read.DIST_COMMON_FILENAME))


def one_round(args, folder) -> dict:
    out = {}
    for checksums in (True, False):
        save = os.path.join(folder, f"save_{checksums}")
        crc = dist_save.tensor_crc
        if not checksums:
            dist_save.tensor_crc = lambda tensor: 0
        try:
            with Timed(dist_save, "write_pieces") as timer:
                pretrain_gpt.main(model_args(args.hidden, args.layers) + ["--save", save, "--save-interval", "1"])
        finally:
            dist_save.tensor_crc = crc
        out[("save", checksums)] = timer.seconds
        if not checksums:
            as_saved_before_checksums(os.path.join(save, "iter_0000001"))
        with Timed(dist_read, "load_keys") as timer:
            pretrain_gpt.main(model_args(args.hidden, args.layers) + ["--load", save, "--train-iters", "1"])
        out[("load", checksums)] = timer.seconds
        out["bytes"] = sum(os.path.getsize(os.path.join(save, "iter_0000001", f))
                           for f in os.listdir(os.path.join(save, "iter_0000001")) if f.endswith(".distcp"))
        shutil.rmtree(save)
    return out


def main(argv=None):
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--hidden", type=positive_int, default=384)
    parser.add_argument("--layers", type=positive_int, default=6)
    args = parser.parse_args(argv)
    print(describe_machine())
    folder = tempfile.mkdtemp(prefix="bench_dist_checksums_")
    try:
        rounds = [one_round(args, folder) for _ in range(args.rounds)]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    size = rounds[0]["bytes"]
    data = torch.zeros(size // 4, dtype=torch.float32)
    crc = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        dist_save.tensor_crc(data)
        crc.append(time.perf_counter() - start)
    print(f"data files: {size / 2**20:.1f} MiB; CRC-32 of that many bytes: {min(crc):.3f} s "
          f"({size / 2**20 / min(crc):.0f} MiB/s)")
    for what in ("save", "load"):
        on, off = (min(r[(what, c)] for r in rounds) for c in (True, False))
        print(f"{what}: with checksums {on:.3f} s, without {off:.3f} s, overhead {on - off:+.3f} s "
              f"({100 * (on - off) / off:+.1f}%); rounds with: {[round(r[(what, True)], 3) for r in rounds]}, "
              f"without: {[round(r[(what, False)], 3) for r in rounds]}")


if __name__ == "__main__":
    main()
