"""Find the user's line in a traceback: the innermost frame outside torch and fxpipe's front end."""

from __future__ import annotations

import os
import sys
import traceback

import torch

__all__ = ["outside_torch", "user_frame"]

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep  # with the separator: torchvision's lines are the user's
_FXPIPE_DIR = os.path.dirname(os.path.dirname(__file__)) + os.sep  # the package: a failure after the model's code ran
# a library's helpers many models call (transformers' torch_compilable_check): the line is their caller's
_HELPERS = (f"{os.sep}transformers{os.sep}utils{os.sep}",)


def user_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """Return the innermost traceback frame outside torch and fxpipe."""
    return outside_torch(traceback.extract_tb(exc.__traceback__))


def outside_torch(frames: list[traceback.FrameSummary]) -> traceback.FrameSummary | None:
    """Return the innermost of ``frames`` outside torch and fxpipe (and not generated code), helpers' callers first."""
    import fxpipe.passes  # installed from its own folder

    skipped = [_TORCH_DIR, _FXPIPE_DIR, os.path.dirname(fxpipe.passes.__file__) + os.sep]
    numpy_file = getattr(sys.modules.get("numpy"), "__file__", None)  # its lines are not the model's (np.random)
    if numpy_file:
        skipped.append(os.path.dirname(numpy_file) + os.sep)
    user = [f for f in frames if not f.filename.startswith(tuple(skipped)) and not f.filename.startswith("<")]
    callers = [f for f in user if not any(h in f.filename for h in _HELPERS)]
    return (callers or user)[-1] if user else None
