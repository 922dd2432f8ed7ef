"""Peak resident memory of this process over a block of code (Linux).

``ru_maxrss`` is no use here: Linux keeps it across ``execve``, so a process started by a big
parent begins with the parent's peak. ``/proc/self/clear_refs`` resets the peak of this
process's own memory map (``VmHWM``), which is then read back after the block.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

__all__ = ["peak_growth", "resident", "reset_peak", "peak"]


def _status(field: str) -> int:
    """Return a ``/proc/self/status`` memory field in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def resident() -> int:
    """Return this process's resident set now, in bytes."""
    return _status("VmRSS")


def peak() -> int:
    """Return the highest resident set since the last :func:`reset_peak`, in bytes."""
    return _status("VmHWM")


def reset_peak() -> None:
    """Reset the peak (``VmHWM``) to the current resident set."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


@contextmanager
def peak_growth() -> Iterator[dict[str, int]]:
    """Measure how far the resident set rises above its level at entry; result in ``["bytes"]``."""
    reset_peak()
    result = {"bytes": 0}
    before = _status("VmRSS")
    try:
        yield result
    finally:
        result["bytes"] = _status("VmHWM") - before
