import os
import sys

import pytest

# Single-process tests: one thread keeps timings steady and leaves the other core to rank pools.
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _seed():
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(1)
    yield
