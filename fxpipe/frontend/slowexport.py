"""Say so when torch.export takes long, naming what shortens it.

With every dim but the batch automatic (``export_dims="auto"``), torch.export reasons over
symbolic sizes; code that pads, windows and reshapes by them (a Swin backbone) can keep it in
sympy for minutes with nothing printed, which reads as a hang. After ``SLOW_S`` seconds a
warning names ``export_dims="batch"``, which keeps those dims the example's.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["SLOW_S", "telling_if_slow"]

log = logging.getLogger(__name__)

SLOW_S = 60.0


@contextmanager
def telling_if_slow(model_name: str, export_dims: str) -> Iterator[None]:
    """Warn once if the block (an export) runs longer than ``SLOW_S`` seconds under ``export_dims="auto"``."""
    if export_dims != "auto":
        yield
        return
    said = ("torch.export has been tracing %s for %.0f s: with every dim but the batch automatic "
            "(export_dims='auto'), it reasons over symbolic sizes, which can take minutes where the model's code "
            "pads, windows or reshapes by them (a Swin backbone). If it does not finish, compile with "
            "export_dims='batch', which keeps those dims the example's (other sizes are then refused)")
    timer = threading.Timer(SLOW_S, log.warning, args=(said, model_name, SLOW_S))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
