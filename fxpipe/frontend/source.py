"""Name the model's own source line on the current stack: the innermost frame outside torch and fxpipe."""

from __future__ import annotations

import contextlib
import os
import traceback

import torch

__all__ = ["model_line"]

_LIBRARIES = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.path.dirname(__file__)) + os.sep,
              contextlib.__file__)


def model_line() -> str | None:
    """Return ``file:line`` of the innermost frame of the current stack outside torch and fxpipe, or None."""
    for frame in reversed(traceback.extract_stack()):
        if not frame.filename.startswith(_LIBRARIES):
            return f"{frame.filename}:{frame.lineno}"
    return None
