"""Warn of gradient hooks a forward registers on its own tensors, which a traced graph drops.

``h.register_hook(fn)`` inside ``forward`` (a gradient scaled or clipped on its way back, an
attention map's gradient saved for explanation) is a side effect on autograd, not an operation:
torch.export runs it on fake tensors and keeps nothing of it, so the hook never runs when the
pipe does; torch.fx cannot record a Python function as an argument at all. Under export
:func:`watching_tensor_hooks` notes where the forward registers one and
:func:`warn_tensor_hooks` names those lines; under fx :func:`refuse_tensor_hook` refuses at the
call. Either way the fix is the one that keeps any Python in forward: a module the graph calls
whole (``leaf_modules=``), where the hook is registered at every call as in eager::

    forward: h = self.a(x); h.register_hook(fn)     export: h = a(x)      (fn dropped: gradients differ)
    leaf:    class Hooked(nn.Module): forward(h): h.register_hook(fn) if torch.is_grad_enabled(); return h
"""

from __future__ import annotations

import traceback
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from fxpipe.errors import TraceError, user_stacklevel
from fxpipe.frontend.userframe import outside_torch

__all__ = ["HookOnProxy", "refuse_tensor_hook", "warn_tensor_hooks", "watching_tensor_hooks"]

_FIX = ("move the call into a small module of its own and trace with tracer='fx' and leaf_modules=[ThatModule] (it "
        "then runs whole at every call, its hook included; guard it with `if torch.is_grad_enabled():`, since a "
        "recomputed stage's first forward runs without grad and its recomputation registers the hook again), or "
        "register the hook outside forward")


class HookOnProxy(Exception):
    """Raised by the fx tracer's proxies at ``register_hook``: turned into :func:`refuse_tensor_hook`'s error."""


@contextmanager
def watching_tensor_hooks() -> Iterator[list[str]]:
    """Yield the list of places (``file:line``) where ``Tensor.register_hook`` is called while the block runs."""
    seen: list[str] = []
    saved = torch.Tensor.register_hook

    def register_hook(self: torch.Tensor, hook: Any) -> Any:
        frame = outside_torch(traceback.extract_stack()[:-1])
        seen.append(f"{frame.filename}:{frame.lineno}" if frame else "forward")
        return saved(self, hook)

    torch.Tensor.register_hook = register_hook  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        torch.Tensor.register_hook = saved  # type: ignore[method-assign]


def warn_tensor_hooks(model_name: str, places: list[str]) -> None:
    """Warn that the exported graph drops the gradient hooks registered at ``places``."""
    if places:
        warnings.warn(
            f"{model_name} registers a gradient hook on a tensor in its forward ({', '.join(dict.fromkeys(places))}), "
            "which torch.export does not keep: the hook never runs when the pipe runs, so a hook that changes the "
            f"gradient leaves the gradients different from eager's. To keep it, {_FIX}", stacklevel=user_stacklevel())


def refuse_tensor_hook(model_name: str, where: str, **context: Any) -> TraceError:
    """Return the error for ``register_hook`` on a traced value under torch.fx, naming the fix."""
    return TraceError(f"{model_name}'s forward registers a gradient hook on a tensor (tensor.register_hook), which "
                      f"torch.fx cannot record and torch.export would drop:{where}\nTo keep it, {_FIX}", **context)
