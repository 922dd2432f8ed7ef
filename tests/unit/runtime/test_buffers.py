"""Receive buffers: one nothing refers to is handed out again; one still in use never is."""

import torch
from torch import nn

from fxpipe.runtime.transport.buffers import BufferPool


def _pool():
    pool = BufferPool(torch.device("cpu"))
    pool.begin()
    return pool


def test_an_idle_buffer_is_handed_out_again():
    pool = _pool()
    a = pool.take((4, 8), torch.float32)
    ptr = a.data_ptr()
    del a
    b = pool.take((4, 8), torch.float32)
    assert b.data_ptr() == ptr and pool.allocated == 1
    assert pool.take((4, 8), torch.float64).dtype == torch.float64 and pool.allocated == 2  # another dtype


def test_a_buffer_still_referred_to_is_not_reused():
    pool = _pool()
    held = pool.take((4, 8), torch.float32)  # a Python reference
    assert pool.take((4, 8), torch.float32).data_ptr() != held.data_ptr()
    alias = pool.take((3,), torch.float32).detach()  # another tensor on its storage
    view = pool.take((6,), torch.float32)[1:]
    assert pool.take((3,), torch.float32).data_ptr() != alias.data_ptr()
    assert pool.take((6,), torch.float32).data_ptr() != view.data_ptr() - 4


def test_a_buffer_autograd_saved_is_not_reused_until_the_backward():
    pool = _pool()
    linear = nn.Linear(8, 8)
    x = pool.take((2, 8), torch.float32).normal_()
    ptr = x.data_ptr()
    y = linear(x.detach().requires_grad_()).sum()  # the input is saved for the weight's gradient
    del x
    other = pool.take((2, 8), torch.float32)
    assert other.data_ptr() != ptr
    del other
    y.backward()
    del y
    assert pool.take((2, 8), torch.float32).data_ptr() == ptr


def test_shapes_a_step_did_not_ask_for_are_dropped():
    pool = _pool()
    pool.take((4,), torch.float32)
    pool.begin()
    pool.take((5,), torch.float32)
    pool.begin()
    assert pool.take((4,), torch.float32) is not None and pool.allocated == 3  # (4,) was dropped, made anew


def test_buffers_off_the_cpu_are_not_pooled():
    pool = BufferPool(torch.device("meta"))
    pool.begin()
    pool.take((4,), torch.float32)
    pool.take((4,), torch.float32)
    assert not pool.reuse and pool.allocated == 2
