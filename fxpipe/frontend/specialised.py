"""Find the line of a model that fixed the batch size to a constant while torch.export traced it.

torch.export refuses a dynamic batch the model's code specialised (``list(x)`` iterates over
the batch; ``for i in range(x.shape[0])``) with "Constraints violated ... specialized it to be
a constant (4)", naming no line. While fxpipe exports, each size torch replaces by a constant
is recorded with the innermost frame of the model's own code (outside torch and fxpipe);
the refusal then names the first that took the example batch's size.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator
from typing import Any

from fxpipe.frontend.userframe import outside_torch

__all__ = ["recording_specialisations", "specialising_line"]


@contextlib.contextmanager
def recording_specialisations(found: list[tuple[int, traceback.FrameSummary]]) -> Iterator[None]:
    """Append ``(constant, the model's frame)`` to ``found`` for each size torch fixes to a constant inside."""
    try:
        from torch.fx.experimental.symbolic_shapes import ShapeEnv
        original = ShapeEnv._set_replacement
    except (ImportError, AttributeError):  # another torch: nothing is recorded, the refusal names no line
        yield
        return

    def record(self: ShapeEnv, a: Any, tgt: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(tgt, "is_Integer", False):
            frame = outside_torch(traceback.extract_stack()[:-1])
            if frame is not None:
                found.append((int(tgt), frame))
        return original(self, a, tgt, *args, **kwargs)

    ShapeEnv._set_replacement = record  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        ShapeEnv._set_replacement = original  # type: ignore[method-assign]


def specialising_line(found: list[tuple[int, traceback.FrameSummary]], rows: int) -> str:
    """Name the first recorded line that fixed a size to ``rows``, as `` at file:line (code)``, or ``""``."""
    frame = next((f for size, f in found if size == rows), None)
    if frame is None:
        return ""
    return f" at {frame.filename}:{frame.lineno} ({(frame.line or '').strip()})"
