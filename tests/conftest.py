"""Shared test set-up: the examples directory is importable, seeds are fixed per test, and
torch uses one thread (the tests' tensors are tiny; on a shared 2-core machine several
OpenMP threads per process only fight each other, and spawned ranks inherit the setting).
Where CUDA is present, matmuls and convolutions use full float32 (no TF32), and the
``cuda_sleep`` fixture keeps a stream busy for the tests that make a stream late on purpose."""

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


if torch.cuda.is_available():
    # Equality with eager at 1e-5 compares full float32 arithmetic: no TF32 in matmuls and convs.
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        torch.backends.cudnn.conv.fp32_precision = "ieee"
    else:  # torch before the fp32_precision flags
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


@pytest.fixture(scope="session")
def cuda_sleep():
    """Return a function that queues ``ms`` milliseconds of GPU busy-waiting on the current stream."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # warm up, then measure how many cycles make a millisecond
    torch.cuda.synchronize()
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    end.synchronize()
    per_ms = 1_000_000 / start.elapsed_time(end)

    def sleep(ms: float) -> None:
        torch.cuda._sleep(int(ms * per_ms))
    return sleep
