"""Warn of ``torch.inference_mode()`` blocks in a forward torch.export traces: the exported graph drops them.

torch.export records the operations inside such a block as ordinary ones: their values carry
gradients in the exported graph where eager's do not (an EMA buffer updated inside passes the
step's gradient through its update, or backward meets its graph a second time). ``torch.no_grad()``
is kept (a ``wrap_with_set_grad_enabled`` body) and is the same as inference mode for a forward.
While the tracer runs, :func:`watching_inference_mode` notes the model's line of each block entered.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from fxpipe.errors import user_stacklevel
from fxpipe.frontend.source import model_line

__all__ = ["warn_inference_mode", "watching_inference_mode"]


@contextlib.contextmanager
def watching_inference_mode(found: list[str]) -> Iterator[None]:
    """Append to ``found`` the model's source line of each ``torch.inference_mode()`` block entered inside."""
    original = torch.inference_mode.__enter__

    def entered(self: Any) -> Any:
        """Note the block's line where it turns inference mode on; then enter it."""
        if getattr(self, "mode", True):
            found.append(model_line() or "the forward")
        return original(self)

    torch.inference_mode.__enter__ = entered  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.inference_mode.__enter__ = original  # type: ignore[method-assign]


def warn_inference_mode(model_name: str, found: list[str]) -> None:
    """Warn of the ``torch.inference_mode()`` blocks ``found`` in the exported forward, naming the fix."""
    if found:
        warnings.warn(
            f"{model_name}'s forward enters torch.inference_mode() at {', '.join(dict.fromkeys(found))}, which "
            "torch.export drops: the values computed there carry gradients in the pipe where eager's do not (a "
            "buffer updated there passes the step's gradient through its update). Use torch.no_grad() there (the "
            "same for a forward), or tracer='fx'", stacklevel=user_stacklevel())
