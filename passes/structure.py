"""Compare the structure of a call's inputs with the one a graph was traced for.

Reads and writes no ``node.meta``: it compares pytree structures (``TreeSpec``), where the
runtime's refusals need the first place two structures part, named by its path (``xs[3]``,
``d['y']``). A dict's keys are compared as a set: a graph reads a dict input by key, so the
same keys in another order are the same input (:func:`in_order_of` puts them back in the
traced order).
"""

from __future__ import annotations

from typing import Any

from torch.utils._pytree import TreeSpec

__all__ = ["difference", "in_order_of"]


def _kind(spec: TreeSpec) -> str:
    """Name the kind of value a spec describes, for a refusal."""
    if spec.is_leaf():
        return "a single value"
    kind = getattr(spec.context, "__name__", None) if getattr(spec.type, "__name__", "") == "namedtuple" else None
    kind = kind or getattr(spec.type, "__name__", str(spec.type))
    return "None" if kind == "NoneType" else f"a {kind} of {spec.num_children} item(s)"


def _keys(spec: TreeSpec) -> list[Any] | None:
    """Return a dict spec's keys, or ``None`` for another kind of value."""
    return list(spec.context) if isinstance(spec.type, type) and issubclass(spec.type, dict) else None


def difference(got: TreeSpec, want: TreeSpec, path: str) -> str | None:
    """Say where ``got`` first differs from ``want`` (``path`` names the value), or return ``None``."""
    if got.is_leaf() or want.is_leaf():
        return None if got.is_leaf() and want.is_leaf() else f"{path} is {_kind(got)}, the plan's is {_kind(want)}"
    if got.type != want.type:
        return f"{path} is {_kind(got)}, the plan's is {_kind(want)}"
    have, keys = _keys(got), _keys(want)
    if have is not None and keys is not None:
        missing, extra = [k for k in keys if k not in have], [k for k in have if k not in keys]
        if missing or extra:
            parts = ([f"lacks the key(s) {missing}"] if missing else []) + (
                [f"has the key(s) {extra} the example had not"] if extra else [])
            return f"{path} {' and '.join(parts)} (the plan's keys: {keys})"
        children = dict(zip(have, got.children()))
        pairs = [(f"{path}[{k!r}]", children[k], w) for k, w in zip(keys, want.children())]
    elif got.num_children != want.num_children:
        return f"{path} is {_kind(got)}, the plan's is {_kind(want)}"
    elif got.context != want.context:
        return f"{path} is {_kind(got)} with fields {got.context}, the plan's has {want.context}"
    else:
        pairs = [(f"{path}[{k}]", g, w) for k, (g, w) in enumerate(zip(got.children(), want.children()))]
    for where, g, w in pairs:
        found = difference(g, w, where)
        if found is not None:
            return found
    return None


def in_order_of(value: Any, like: Any) -> Any:
    """Return ``value`` with every dict's keys in the order of the same dict in ``like`` (the same keys)."""
    if type(value) is dict and type(like) is dict and set(value) == set(like):
        return {k: in_order_of(value[k], like[k]) for k in like}
    if type(value) in (list, tuple) and type(like) is type(value) and len(value) == len(like):
        return type(value)(in_order_of(v, w) for v, w in zip(value, like))
    return value
