"""Record the ``torch.nn.init`` functions that do nothing on meta as one op each, replayed whole.

``nn.init.trunc_normal_``, ``orthogonal_``, ``dirac_`` and ``sparse_`` return at once for a
meta tensor (their algorithms read values: a rejection loop, a QR factorization, random row
indices), so under :func:`fxpipe.deferred_init` no aten op would be seen and the tensor would
keep its earlier values (a ViT's position embeddings at std 1.0 instead of 0.02). While
recording, each of them called on a recorded meta tensor becomes one op of the recording
whose function is the init function itself: the replay runs it on the real tensor, drawing
from the owning module's random stream like any random op.

Reads and writes no ``node.meta``; adds ops to the recording of :func:`fxpipe.materialize.deferred_init`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

__all__ = ["recording_init_calls"]

# the functions of torch.nn.init that return at once for a meta tensor, and whether they draw random
# numbers; trunc_normal_ through its helper, which it looks up at each call, so that code holding
# the function itself (``from torch.nn.init import trunc_normal_``) is recorded too
_SKIPPING_META = {"_no_grad_trunc_normal_" if hasattr(torch.nn.init, "_no_grad_trunc_normal_") else "trunc_normal_": True,
                  "orthogonal_": True, "dirac_": False, "sparse_": True}


class InitCall:
    """A ``torch.nn.init`` function as a recorded op: called on the replayed tensor, without autograd."""

    def __init__(self, fn: Callable[..., Any], random: bool) -> None:
        self.fn = fn
        self.tags = [torch.Tag.nondeterministic_seeded] if random else []  # as an aten op's tags

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the init function on real tensors."""
        with torch.no_grad():
            return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"torch.nn.init.{self.fn.__name__.replace('_no_grad_', '')}"


@contextmanager
def recording_init_calls(recorder: Any) -> Iterator[None]:
    """Record the meta-skipping init functions called on meta tensors through ``recorder`` (unless it is paused).

    ``recorder`` is :func:`fxpipe.materialize.deferred.deferred_init`'s dispatch mode: its
    ``record`` keeps the call as it keeps any aten op writing ``tensor``.
    """
    originals = {name: getattr(torch.nn.init, name) for name in _SKIPPING_META}

    def recorded(name: str) -> Callable[..., Any]:
        original, op = originals[name], InitCall(originals[name], _SKIPPING_META[name])

        def init(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            """Record the call on a meta tensor (after the function's own checks); run it otherwise."""
            original(tensor, *args, **kwargs)  # checks the arguments; returns at once on meta
            if isinstance(tensor, torch.Tensor) and tensor.is_meta and not recorder.paused:
                leaves, spec = tree_flatten(((tensor, *args), kwargs))
                recorder.record(op, leaves, spec, [tensor])  # runs it on meta (a no-op), keeps it
            return tensor

        init.__name__ = init.__qualname__ = name
        init.__doc__ = original.__doc__
        return init

    for name in _SKIPPING_META:
        setattr(torch.nn.init, name, recorded(name))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(torch.nn.init, name, fn)
