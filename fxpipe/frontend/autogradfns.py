"""Refuse a custom ``torch.autograd.Function`` the tracers trace through, dropping its backward.

torch.fx and torch.export both run a Function's ``forward`` on their proxies or fake tensors and
record the operations it makes: the graph keeps the forward and loses the ``backward`` the user
wrote. Where that backward is the forward's own gradient (a memory-efficient activation: Bloom's
GeLU, RecurrentGemma's bounded square root, timm's ``SwishMe``) nothing changes but memory; where it is not (a
straight-through estimator, a clipped or scaled gradient) the pipeline's gradients would differ
from eager's. While a tracer runs, :func:`watching_functions` notes every Function applied;
:func:`check_functions` warns of each, naming the fix that keeps its backward. torch's own
Functions trace faithfully, except the reentrant ``torch.utils.checkpoint``, whose exported graph
leaves every gradient ``None``: that one is refused.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from fxpipe.errors import TraceError, user_stacklevel

__all__ = ["applying", "check_functions", "watching_functions"]

_ENTERED: list[bool] = []  # per Function.apply the watched trace is inside: whether grad was on at the call


def applying() -> bool | None:
    """Tell whether the trace is inside a ``Function.apply`` called with grad on (None: inside none watched).

    Its forward runs with grad off, and autograd differentiates it; one called under the
    user's ``torch.no_grad()`` is not differentiated, as the rest of that block.
    """
    return _ENTERED[0] if _ENTERED else None


@contextlib.contextmanager
def watching_functions() -> Iterator[list[type]]:
    """Yield the list of ``torch.autograd.Function`` classes applied while the block runs."""
    seen: list[type] = []
    saved = torch.autograd.Function.__dict__["apply"]  # a classmethod, or (torch >= 2.14) a C one

    def apply(cls: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(cls)
        _ENTERED.append(torch.is_grad_enabled())
        try:
            return saved.__get__(None, cls)(*args, **kwargs)
        finally:
            _ENTERED.pop()

    torch.autograd.Function.apply = classmethod(apply)  # type: ignore[method-assign, assignment]
    try:
        yield seen
    finally:
        torch.autograd.Function.apply = saved  # type: ignore[method-assign]


def check_functions(model_name: str, seen: list[type], tracer: str) -> None:
    """Warn of each Function in ``seen`` whose backward ``tracer`` drops; refuse what leaves no gradient at all."""
    for cls in dict.fromkeys(seen):
        module = getattr(cls, "__module__", "") or ""
        if module.startswith("torch.utils.checkpoint") and tracer == "export":
            raise TraceError(
                f"{model_name} calls torch.utils.checkpoint with use_reentrant=True, which torch.export traces into "
                "a graph whose outputs need no gradient: every .grad would stay None. Pass use_reentrant=False "
                "(or turn the model's own gradient checkpointing off: fxpipe's checkpoint= recomputes stages), or "
                "use tracer='fx'")
        if module.startswith(("torch.", "fxpipe.")) or module == "torch":
            continue
        name = f"{module}.{cls.__qualname__}"
        fix = ("wrap the .apply call in a module and pass leaf_modules=[ThatModule]: the module then runs whole, "
               "with its backward" if tracer == "fx" else
               "trace with tracer='fx', wrapping the .apply call in a module passed as leaf_modules=[ThatModule] "
               "(it then runs whole, with its backward)")
        warnings.warn(
            f"{model_name} applies {name}, a torch.autograd.Function, and {tracer} traces through its forward: the "
            "graph keeps the forward and drops its own backward, so the pipeline differentiates the forward instead. "
            "Where that backward is the forward's gradient (a memory-efficient activation) nothing changes but "
            f"memory; where it is not (a straight-through estimator, a clipped gradient), {fix}", stacklevel=user_stacklevel())
