"""Copy out of a memory-mapped file without keeping its pages: file pages count as resident memory.

A tensor read from a file mapped with ``torch.load(mmap=True)`` brings its pages into this
process's resident set as it is touched, and they stay there while the file is mapped. On
Linux, ``madvise(MADV_DONTNEED)`` gives clean file pages back (they are read again if touched),
so copying slice by slice and dropping each slice keeps at most one slice resident. Elsewhere
the copy is the same and the pages stay until the file is unmapped.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from collections.abc import Callable

import torch

__all__ = ["copy_dropping"]


def _madvise() -> Callable[[int, int], None] | None:
    """Return ``madvise(address, length)`` with MADV_DONTNEED on Linux, else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

    def drop(address: int, length: int) -> None:
        fn(address, length, 4)  # MADV_DONTNEED: clean file pages are read again if touched

    return drop


_DROP = _madvise()


def copy_dropping(target: torch.Tensor, source: torch.Tensor, chunk: int = 1 << 23) -> None:
    """Copy a memory-mapped ``source`` into ``target`` by slices of about ``chunk`` bytes, dropping each's pages."""
    row = source[0].numel() * source.element_size() if source.dim() else 0
    if not row or not source.is_contiguous() or source.numel() * source.element_size() <= chunk:
        target.copy_(source)
        _drop_pages(source)
        return
    step = max(1, chunk // row)
    for i in range(0, source.shape[0], step):
        target[i:i + step].copy_(source[i:i + step])
        _drop_pages(source[i:i + step])


def _drop_pages(tensor: torch.Tensor) -> None:
    """Drop the whole pages of a memory-mapped tensor from this process's resident set."""
    if _DROP is None or tensor.device.type != "cpu":
        return
    page = mmap.PAGESIZE
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first, last = -(-start // page) * page, end // page * page
    if last > first:
        _DROP(first, last - first)
