"""Notice a forward drawing Python's or NumPy's random numbers while it is traced: the graph keeps the draw.

A tracer runs the forward's Python once. ``random.uniform(0, 1)`` or ``np.random.random()``
returns a plain number then, which the graph keeps as a constant (or a branch taken): a
LayerDrop written so (transformers' Wav2Vec2 adapter, older audio models) keeps or drops the
same layers at every step, where eager draws anew each call. ``torch.rand`` is traced as an
op and draws at run time. While fxpipe traces, each such call is noted by the model's source
line; :func:`warn_python_random` names them in a warning with the fixes.

Reads and writes no ``node.meta``.
"""

from __future__ import annotations

import contextlib
import logging
import random
import sys
from collections.abc import Iterator
from typing import Any

from fxpipe.frontend.source import model_line

__all__ = ["recording_python_random", "warn_python_random"]

log = logging.getLogger(__name__)

_RANDOM = ("random", "uniform", "randint", "randrange", "choice", "gauss", "normalvariate", "betavariate")
_NUMPY = ("random", "rand", "randn", "uniform", "randint", "normal", "choice", "binomial")


@contextlib.contextmanager
def recording_python_random(found: list[str]) -> Iterator[None]:
    """Append to ``found`` the model's source line of each Python or NumPy random draw made inside."""
    patched: list[tuple[Any, str, Any]] = []
    owners = [(random, _RANDOM)]
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        owners.append((numpy.random, _NUMPY))
    for owner, names in owners:
        for name in names:
            original = getattr(owner, name, None)
            if original is None:
                continue

            def noted(*args: Any, _original: Any = original, _name: str = f"{owner.__name__}.{name}",
                      **kwargs: Any) -> Any:
                """Note the draw's source line; then draw."""
                found.append(f"{_name} ({model_line() or 'the forward'})")
                return _original(*args, **kwargs)

            patched.append((owner, name, original))
            setattr(owner, name, noted)
    try:
        yield
    finally:
        for owner, name, original in patched:
            setattr(owner, name, original)


def warn_python_random(model_name: str, found: list[str], tracer: str) -> None:
    """Warn that the traced graph keeps the random numbers the forward drew while traced."""
    if not found:
        return
    calls = ", ".join(dict.fromkeys(found))
    fix = ("list the module drawing them in leaf_modules= (its forward then runs each call)" if tracer == "fx"
           else "use tracer='fx' with the module drawing them in leaf_modules=")
    log.warning("%s's forward draws Python or NumPy random numbers while traced: %s. The graph keeps the numbers "
                "drawn then, so every step reuses them where eager draws anew (a LayerDrop keeps or drops the same "
                "layers at every step); draw them with torch (torch.rand is traced as an op), turn them off "
                "(a layerdrop of 0), or %s", model_name, calls, fix)
