"""Shared test set-up for every layer of tests.

    tests/unit/<package>/   one process, grouped as the package is
    tests/distributed/      several processes (gloo ranks, torchrun): marked ``distributed``
    tests/cuda/             need CUDA (marked ``cuda``; skipped without a GPU)
    tests/real_models/      torchvision, timm and transformers models (marked ``real_models``)
    tests/support/          the models, multi-process cases and the launcher the tests share

The support folder and the examples are importable, seeds are fixed per test, and torch uses
one thread (the tests' tensors are tiny; on a shared 2-core machine several OpenMP threads per
process only fight each other, and spawned ranks inherit the setting). The ``launch`` fixture
runs a case on spawned ranks (:mod:`launch`). Tests slower than about 5 s in one process are
marked ``slow``; ``pytest -m "not distributed and not slow"`` is the fast loop. Where CUDA is
present, matmuls and convolutions use full float32 (no TF32), and the ``cuda_sleep`` fixture
keeps a stream busy for the tests that make a stream late on purpose."""

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, os.path.join(HERE, "support"))


def pytest_collection_modifyitems(config, items):
    """Mark every test under tests/distributed ``distributed``; leave out ``real_models`` unless ``-m`` asks."""
    folder = os.path.join(HERE, "distributed") + os.sep
    for item in items:
        if str(item.fspath).startswith(folder):
            item.add_marker(pytest.mark.distributed)
            # under pytest-xdist the multi-rank tests run one at a time on one worker (their
            # ranks fill the cores), beside the one-process tests on the other
            item.add_marker(pytest.mark.xdist_group("ranks"))
    if "real_models" not in (config.option.markexpr or ""):
        left_out = [item for item in items if "real_models" in item.keywords]
        if left_out:
            config.hook.pytest_deselected(items=left_out)
            items[:] = [item for item in items if "real_models" not in item.keywords]


@pytest.fixture
def launch():
    """Return the launcher of multi-process cases: ``launch("module:case", world, schedule, tmp_path)``."""
    from launch import launch as run_on_ranks

    return run_on_ranks


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
