import os
import sys

import pytest

# Single-process tests: one thread keeps timings steady and leaves the other core to rank pools.
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _memoise_field_docs() -> None:
    """megatron_lite.arguments._field_docs reads and parses each config class's source again for every
    parser built (~80% of a build_parser, ~0.04-0.09 s; thousands of parses in this process: every
    pretrain_*.main and every flag refusal). The source does not change during a session, so its
    result per class is kept here (the function itself runs as in production, once per class)."""
    import functools

    from megatron_lite import arguments

    arguments._field_docs = functools.cache(arguments._field_docs)


_memoise_field_docs()


@pytest.fixture(autouse=True)
def _seed():
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(1)
    yield
