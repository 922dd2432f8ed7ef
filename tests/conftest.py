"""Shared test set-up: the examples directory is importable, seeds are fixed per test, and
torch uses one thread (the tests' tensors are tiny; on a shared 2-core machine several
OpenMP threads per process only fight each other, and spawned ranks inherit the setting)."""

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
