"""Cut a sequence of costs into contiguous blocks with the least largest block: fxpipe's exact cut.

torchgpipe answers this with a block-partition heuristic; here it is fxpipe's partitioner
(:func:`fxpipe.passes.balanced_cut`, an exact minimum-bottleneck cut), so the balance it
returns is optimal for the measured costs.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TypeVar

from fxpipe import passes

__all__ = ["solve"]

T = TypeVar("T", int, float)


def solve(sequence: Sequence[T], partitions: int = 1) -> list[list[T]]:
    """Split ``sequence`` into ``partitions`` non-empty contiguous blocks minimizing the largest sum.

    Raises ValueError when ``partitions`` is below 1 or above ``len(sequence)``.
    """
    if partitions < 1:
        raise ValueError(f"partitions must be a positive integer ({partitions} < 1)")
    if len(sequence) < partitions:
        raise ValueError(f"sequence is shorter than intended partitions ({len(sequence)} < {partitions})")
    starts = passes.balanced_cut([float(c) for c in sequence], partitions) + [len(sequence)]
    return [list(sequence[a:b]) for a, b in itertools.pairwise(starts)]
