"""Leave the model's Python state as it was while a pass runs its modules on fake tensors.

Reads:  every module of the GraphModule whose code is not ``torch.nn``'s (its ``__dict__``:
        attributes, and the dicts, lists and sets they hold, but for the tensors, children and
        hooks every module holds, which the passes swap and put back themselves).
Writes: no ``node.meta``; :func:`modules_untouched` puts each module's attributes back after
        the block: attributes added are removed, replaced ones restored, and containers
        emptied and refilled with what they held.

Shape propagation calls leaf modules' own ``forward`` under ``FakeTensorMode``. A module that
caches a tensor in Python (timm's TinyViT and LeViT keep attention biases per device in a dict
in eval mode) would otherwise keep a fake tensor from the pass, and every real step after
would compute with it (a fake loss in one process; across ranks a fake tensor sent, and the
receiving rank waiting for its timeout).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["modules_untouched"]

_CONTAINERS = (dict, list, set)
_INTERNAL = frozenset(vars(torch.nn.Module()))  # what every module holds: its tensors, children and hooks


def _own_code(module: torch.nn.Module) -> bool:
    """Tell whether a module's forward is code outside ``torch.nn`` (``torch.nn``'s keep no Python state)."""
    return not type(module).__module__.startswith("torch.nn.")


def _copy(value: Any) -> Any:
    """Return a shallow copy of a container's contents, or None for other values."""
    return value.copy() if isinstance(value, _CONTAINERS) else None


def _same(container: Any, contents: Any) -> bool:
    """Tell whether ``container`` holds the very objects of ``contents`` (by identity: tensors do not compare)."""
    if len(container) != len(contents):
        return False
    if isinstance(container, dict):
        return all(k in contents and contents[k] is v for k, v in container.items())
    if isinstance(container, list):
        return all(a is b for a, b in zip(container, contents))
    return container == contents  # a set: its members hash by identity or by value alike


def _refill(container: Any, contents: Any) -> None:
    """Give ``container`` (the same object) back ``contents``."""
    if _same(container, contents):
        return
    if isinstance(container, list):
        container[:] = contents
    else:
        container.clear()
        container.update(contents)


@contextmanager
def modules_untouched(root: torch.nn.Module) -> Iterator[None]:
    """Put every module of ``root`` back as it was before the block: its attributes and their containers."""
    saved = []
    for module in root.modules():
        if not _own_code(module):
            continue
        attrs = vars(module)
        saved.append((module, dict(attrs), {k: _copy(v) for k, v in attrs.items()
                                            if k not in _INTERNAL and isinstance(v, _CONTAINERS)}))
    try:
        yield
    finally:
        for module, before, contents in saved:
            attrs = vars(module)
            for key in [k for k in attrs if k not in before]:
                del attrs[key]
            for key, value in before.items():
                if attrs.get(key) is not value:
                    attrs[key] = value
                if key in contents and isinstance(value, _CONTAINERS):
                    _refill(value, contents[key])
