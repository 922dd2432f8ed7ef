"""A model in its other mode: whether its graph may depend on the mode, and the model flipped while traced.

A tracer fixes in its graph the mode (``model.training``) the model was in; fxpipe traces the
model in the other mode too where its code may read the mode, and merges the two graphs
(:func:`fxpipe.passes.modes.merge_modes`) so the pipe follows ``pipe.train()`` and
``pipe.eval()`` as eager does.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Iterator

from torch import nn

__all__ = ["in_other_mode", "may_read_mode", "quieted"]


def may_read_mode(model: nn.Module, torch_nn: bool = False) -> bool:
    """Tell whether the source of a module class of ``model`` mentions ``training`` (else one trace is enough).

    Classes of ``torch.nn`` count only with ``torch_nn`` (torch.export traces into dropout and
    batch norm; torch.fx keeps them as modules, which read the mode when they run). A class
    traced through is read with its bases: a ``forward`` it inherits (``class MyDropout(nn.Dropout)``,
    whose module is not ``torch.nn``, is traced through by fx) reads the mode too.
    """
    classes: set[type] = {type(m) for m in model.modules() if torch_nn or not type(m).__module__.startswith("torch.nn.")}
    bases: set[type] = {base for cls in classes for base in cls.__mro__
             if issubclass(base, nn.Module) and base is not nn.Module}
    return any(_mentions_training(cls) for cls in bases)


@functools.cache
def _mentions_training(cls: type) -> bool:
    """Tell whether the source of ``cls`` mentions ``training`` (read once per class)."""
    try:
        return "training" in inspect.getsource(cls)
    except (OSError, TypeError):  # no source to read: it may
        return True


@contextlib.contextmanager
def in_other_mode(model: nn.Module) -> Iterator[None]:
    """Put ``model`` in the other mode for the block; give every module its own mode back after it."""
    modes = {m: m.training for m in model.modules()}
    try:
        model.train(not model.training)
        yield
    finally:
        for m, training in modes.items():
            m.training = training


@contextlib.contextmanager
def quieted(*loggers: str) -> Iterator[None]:
    """Silence the warnings of ``loggers`` for the block (the first trace gave them)."""
    levels = [(logging.getLogger(name), logging.getLogger(name).level) for name in loggers]
    for logger, _ in levels:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in levels:
            logger.setLevel(level)
