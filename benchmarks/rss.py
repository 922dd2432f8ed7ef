"""Peak resident memory of this process over a block of code (Linux).

``ru_maxrss`` is no use here: Linux keeps it across ``execve``, so a process started by a big
parent begins with the parent's peak. ``/proc/self/clear_refs`` resets the peak of this
process's own memory map (``VmHWM``), which is then read back after the block.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

__all__ = ["peak_growth"]


def _status(field: str) -> int:
    """Return a ``/proc/self/status`` memory field in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


@contextmanager
def peak_growth() -> Iterator[dict[str, int]]:
    """Measure how far the resident set rises above its level at entry; result in ``["bytes"]``."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident set
    result = {"bytes": 0}
    before = _status("VmRSS")
    try:
        yield result
    finally:
        result["bytes"] = _status("VmHWM") - before
