"""Copies between devices on copy streams (fxpipe.runtime.stage.copy and .stream), on real CUDA.

Every copy waits for the stream that made its input, and the stream that reads its output
waits for the copy, in forward and in backward; a copy to the CPU is complete when it
returns; the caching allocator keeps a copy's memory while another stream still reads it.
Each test first makes one stream busy (``torch.cuda._sleep``), so that a missing wait reads
memory that is not yet written instead of passing by luck::

    compute ──sleep── x.add_(1) ─wait─▶ copy stream ══copy══▶ reader      (must see 1, not 0)
"""

import pytest
import torch

from fxpipe.runtime.stage.copy import copy, transfer, wait
from fxpipe.runtime.stage.stream import current_stream, new_stream, use_stream

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")

CPU = torch.device("cpu")
GPU = torch.device("cuda", 0)
N = 1 << 22  # 16 MiB of float32: copies long enough to race
LATE = 50  # milliseconds a stream is kept busy


def test_copy_to_the_cpu_waits_for_the_compute_and_is_done_on_return(cuda_sleep):
    compute, side = current_stream(GPU), new_stream(GPU)
    x = torch.zeros(N, device=GPU)
    cuda_sleep(LATE)  # on the compute stream: x becomes 1 only after it
    x.add_(1)
    (x,) = wait((x,), compute, side)  # the producer's side of a copy
    (y,) = copy((x,), side, None, CPU)
    assert y.device == CPU
    assert torch.equal(y, torch.ones(N))  # the host reads it at once


def test_compute_waits_for_a_copy_to_the_gpu(cuda_sleep):
    compute, side = current_stream(GPU), new_stream(GPU)
    with use_stream(side):
        cuda_sleep(LATE)  # the copy stream is busy: the copy lands late
    (y,) = copy((torch.ones(N),), None, side, GPU)
    (y,) = wait((y,), side, compute)
    z = y * 2  # on the compute stream
    assert torch.equal(z.cpu(), torch.full((N,), 2.0))


def test_gradient_copied_to_the_gpu_is_waited_for(cuda_sleep):
    # forward GPU -> CPU, so backward copies the CPU stage's gradient to the GPU
    compute, side = current_stream(GPU), new_stream(GPU)
    a = torch.ones(N, device=GPU, requires_grad=True)
    (h,) = wait((a * 3,), compute, side)
    (c,) = copy((h,), side, None, CPU)
    out = (c * 5).sum()
    with use_stream(side):
        cuda_sleep(LATE)  # the gradient's copy lands late
    out.backward()
    assert torch.equal(a.grad.cpu(), torch.full((N,), 15.0))


def test_gradient_copied_to_the_cpu_waits_for_the_gpu_backward(cuda_sleep):
    # forward CPU -> GPU, so backward copies the GPU stage's gradient to the CPU
    compute, side = current_stream(GPU), new_stream(GPU)
    b = torch.ones(N, requires_grad=True)
    (y,) = copy((b * 2,), None, side, GPU)
    (y,) = wait((y,), side, compute)
    out = (y * 7).sum()
    cuda_sleep(LATE)  # the compute stream is busy: the GPU's gradient is written late
    out.backward()
    assert torch.equal(b.grad, torch.full((N,), 14.0))


def test_nested_values_are_copied_and_waited_for(cuda_sleep):
    compute, side = current_stream(GPU), new_stream(GPU)
    with use_stream(side):
        cuda_sleep(LATE)
    values = ((torch.ones(4), {"k": torch.full((4,), 2.0)}), 3)
    moved = wait(copy(values, None, side, GPU), side, compute)
    (a, d), three = moved
    assert three == 3 and a.device == GPU and d["k"].device == GPU
    assert torch.equal((a + d["k"]).cpu(), torch.full((4,), 3.0))


def test_a_copy_read_on_another_stream_keeps_its_memory(cuda_sleep):
    side, reader = new_stream(GPU), new_stream(GPU)
    x = torch.ones(N)
    # the check can fail: without record_stream, a freed block is reused at once on its stream
    with use_stream(side):
        plain = x.to(GPU)
    ptr = plain.data_ptr()
    del plain
    with use_stream(side):
        again = torch.empty(N, device=GPU)
    assert again.data_ptr() == ptr
    del again
    torch.cuda.synchronize()

    (y,) = transfer([x], None, side, GPU, reader)  # allocated on the copy stream, read on `reader`
    reader.wait_stream(side)
    with use_stream(reader):
        cuda_sleep(LATE)
        z = y * 2  # reads y after the sleep
    ptr = y.data_ptr()
    del y
    with use_stream(side):
        w = torch.zeros(N, device=GPU)  # would overwrite y before `reader` read it
    assert w.data_ptr() != ptr
    reader.synchronize()
    assert torch.equal(z.cpu(), torch.full((N,), 2.0))


@two_gpus
def test_copy_between_gpus_waits_on_both_sides(cuda_sleep):
    g1 = torch.device("cuda", 1)
    c0, s0, s1, c1 = current_stream(GPU), new_stream(GPU), new_stream(g1), current_stream(g1)
    x = torch.zeros(N, device=GPU)
    cuda_sleep(LATE)  # producer late
    x.add_(1)
    (x,) = wait((x,), c0, s0)
    with use_stream(s1):
        cuda_sleep(LATE)  # the receiving copy stream busy too
    (y,) = copy((x,), s0, s1, g1)
    (y,) = wait((y,), s1, c1)
    with torch.cuda.device(g1):
        z = y * 2
    assert z.device == g1
    assert torch.equal(z.cpu(), torch.full((N,), 2.0))


@two_gpus
def test_copy_between_gpus_keeps_the_source_memory_while_it_reads(cuda_sleep):
    g1 = torch.device("cuda", 1)
    s0, s1 = new_stream(GPU), new_stream(g1)
    x = torch.ones(N, device=GPU)
    torch.cuda.synchronize(GPU)
    with use_stream(s0):
        cuda_sleep(LATE)  # the copy reads x late
    (y,) = transfer([x], s0, s1, g1, current_stream(g1))
    ptr = x.data_ptr()
    del x
    w = torch.zeros(N, device=GPU)  # on the compute stream: must not take x's block yet
    assert w.data_ptr() != ptr
    torch.cuda.synchronize(g1)
    assert torch.equal(y.cpu(), torch.ones(N))
