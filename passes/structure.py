"""Compare the structure of a call's inputs with the one a graph was traced for.

Reads and writes no ``node.meta``: it compares pytree structures (``TreeSpec``), where the
runtime's refusals need the first place two structures part, named by its path (``xs[3]``,
``d['y']``). A dict's keys are compared as a set: a graph reads a dict input by key, so the
same keys in another order are the same input (:func:`in_order_of` puts them back in the
traced order).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from torch.utils._pytree import TreeSpec

__all__ = ["as_containers", "difference", "in_order_of"]


def _kind(spec: TreeSpec) -> str:
    """Name the kind of value a spec describes, for a refusal."""
    if spec.is_leaf():
        return "a single value"
    kind = getattr(spec.context, "__name__", None) if getattr(spec.type, "__name__", "") == "namedtuple" else None
    kind = kind or getattr(spec.type, "__name__", str(spec.type))
    return "None" if kind == "NoneType" else f"a {kind} of {spec.num_children} item(s)"


def _keys(spec: TreeSpec) -> list[Any] | None:
    """Return a dict spec's keys (an ``OrderedDict``'s, a ``defaultdict``'s too), or ``None`` for another kind."""
    if isinstance(spec.type, type) and issubclass(spec.type, dict):
        return list(spec.context if spec.type is not defaultdict else spec.context[1])
    return None


def _sequence(spec: TreeSpec) -> bool:
    """Tell whether a spec is a list or a tuple (a named one too): indexed by position alike."""
    return spec.type in (list, tuple) or getattr(spec.type, "__name__", "") == "namedtuple"


def difference(got: TreeSpec, want: TreeSpec, path: str, extra_keys: bool = False) -> str | None:
    """Say where ``got`` first differs from ``want`` (``path`` names the value), or return ``None``.

    A graph reads a list, a tuple or a named tuple by position and a dict of any kind by key,
    so those kinds stand in for each other (a ``DataLoader`` collates a tuple into a list);
    ``extra_keys`` allows keys the plan's dict has not (a graph that only reads by key).
    """
    if got.is_leaf() or want.is_leaf():
        if got.is_leaf() and want.is_leaf():
            return None
        hint = (" (a mapping torch's pytree does not know, such as a tokenizer's BatchEncoding, is one value: pass "
                "dict(...) of it)") if got.is_leaf() and _keys(want) is not None else ""
        return f"{path} is {_kind(got)}, the plan's is {_kind(want)}{hint}"
    have, keys = _keys(got), _keys(want)
    if have is not None and keys is not None:
        missing, extra = [k for k in keys if k not in have], [k for k in have if k not in keys]
        if missing or (extra and not extra_keys):
            parts = ([f"lacks the key(s) {missing}"] if missing else []) + (
                [f"has the key(s) {extra} the example had not"] if extra and not extra_keys else [])
            return f"{path} {' and '.join(parts)} (the plan's keys: {keys})"
        children = dict(zip(have, got.children()))
        pairs = [(f"{path}[{k!r}]", children[k], w) for k, w in zip(keys, want.children())]
    elif _sequence(got) and _sequence(want) or got.type == want.type:
        if got.num_children != want.num_children:
            return f"{path} is {_kind(got)}, the plan's is {_kind(want)}"
        if not _sequence(got) and got.context != want.context:
            return f"{path} is {_kind(got)} with fields {got.context}, the plan's has {want.context}"
        pairs = [(f"{path}[{k}]", g, w) for k, (g, w) in enumerate(zip(got.children(), want.children()))]
    else:
        return f"{path} is {_kind(got)}, the plan's is {_kind(want)}"
    for where, g, w in pairs:
        found = difference(g, w, where, extra_keys)
        if found is not None:
            return found
    return None


def as_containers(value: Any) -> Any:
    """Return ``value`` with every mapping as a plain dict (an ``OrderedDict``, a tokenizer's ``BatchEncoding``).

    For an exported graph, which reads a dict input by key: torch's flattening by the example's
    spec reads only a plain dict by key, and refuses an ``OrderedDict`` of another order.
    """
    if isinstance(value, Mapping):
        return {k: as_containers(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(as_containers(v) for v in value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple: its fields, not its items
        return type(value)(*(as_containers(v) for v in value))
    return value


def in_order_of(value: Any, like: Any) -> Any:
    """Return ``value`` with every dict's keys in the order of the same dict in ``like`` (the same keys), as a dict."""
    if isinstance(value, dict) and isinstance(like, dict) and set(value) == set(like):
        return {k: in_order_of(value[k], like[k]) for k in like}
    if type(value) in (list, tuple) and isinstance(like, (list, tuple)) and len(value) == len(like):
        return type(value)(in_order_of(v, w) for v, w in zip(value, like))
    return value
