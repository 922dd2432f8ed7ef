"""Dataclass values (a model's output record, what a module returns) as pytree nodes.

Reads:  a value, or a graph's ``call_function`` nodes whose target is a dataclass.
Writes: torch's pytree registry: each dataclass type met that is not a pytree node yet is
        registered as one (its fields are its children, ``init=False`` ones too), as ``torch.export``
        asks users to do (``register_dataclass``); rebuilt without calling ``__init__``, so a
        ``__post_init__`` deriving a field runs once, as in eager.

fxpipe splits, sends, checkpoints and joins values through torch's pytree. An unregistered
dataclass is one opaque leaf to it: a model returning ``Out(logits=...)`` had its outputs
refused as differing between micro-batches, and a record crossing a stage boundary reached
the next stage without a path back for the gradients (its tensors were not seen as tensors).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, cast

import torch.fx
from torch.utils import _pytree as pytree

__all__ = ["built_record", "extras", "record_builder", "register_graph_records", "register_record_type", "register_records"]

log = logging.getLogger(__name__)


def register_records(value: Any) -> None:
    """Register as pytree nodes the dataclass types of every record inside ``value``."""
    if isinstance(value, (tuple, list)):
        for item in value:
            register_records(item)
    elif isinstance(value, dict):
        for item in value.values():
            register_records(item)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        register_record_type(type(value))
        for field in dataclasses.fields(value):
            register_records(getattr(value, field.name, None))


def register_graph_records(gm: torch.fx.GraphModule) -> None:
    """Register the dataclass types a graph constructs (torch.fx records ``Out(logits=...)`` as a call)."""
    for node in gm.graph.nodes:
        cls = built_record(node.target) if node.op == "call_function" else None
        if cls is not None and dataclasses.is_dataclass(cls):
            register_record_type(cls)


def built_record(target: Any) -> type | None:
    """Return the record class a ``call_function`` target builds (the class, or its builder), else None."""
    if isinstance(target, type):
        return target
    return getattr(target, "fxpipe_record", None)


def extras(record: Any) -> tuple[str, ...]:
    """Return the attributes a record holds that are not its fields (``self.probs = ...`` in ``__post_init__``)."""
    fields = {f.name for f in dataclasses.fields(record)}
    return tuple(k for k in getattr(record, "__dict__", {}) if k not in fields)


_BUILDERS: dict[type, Any] = {}


def record_builder(cls: type) -> Any:
    """Return the graph target that builds a ``cls`` record from its fields without calling ``__init__``.

    torch.fx records a dataclass the forward built as a call of its class on the fields' final
    values: the call ran ``__post_init__`` again (a field it doubles came back 4x), refused
    ``init=False`` fields and lost attributes ``__post_init__`` set beside them. The builder
    sets all of them as they were.
    """
    if cls not in _BUILDERS:
        def build(**fields: Any) -> Any:
            record: Any = object.__new__(cls)
            for name, value in fields.items():
                object.__setattr__(record, name, value)  # a frozen dataclass's too
            return record

        build.__name__ = build.__qualname__ = f"build_{cls.__name__}"
        build.fxpipe_record = cls  # type: ignore[attr-defined]
        _BUILDERS[cls] = build
    return _BUILDERS[cls]


def register_record_type(cls: type) -> None:
    """Register one dataclass type, unless torch's pytree knows it already."""
    if cls in pytree.SUPPORTED_NODES:
        return
    names = [f.name for f in dataclasses.fields(cls)]  # init=False ones too (set by __post_init__)
    container = issubclass(cls, (dict, list, tuple))

    def present(obj: Any) -> tuple[str, ...]:
        """Return the fields ``obj`` holds (an ``init=False`` one may be unset), then what else ``__post_init__`` set."""
        return tuple(n for n in names if hasattr(obj, n)) + (() if container else extras(obj))

    def flatten(obj: Any) -> tuple[list[Any], Any]:
        held = present(obj)
        return [getattr(obj, n) for n in held], held

    def flatten_with_keys(obj: Any) -> tuple[list[tuple[Any, Any]], Any]:
        held = present(obj)
        return [(pytree.GetAttrKey(n), getattr(obj, n)) for n in held], held

    init = {f.name for f in dataclasses.fields(cls) if f.init}

    def unflatten(values: Any, context: Any) -> Any:
        fields = dict(zip(context, values))
        if not container:
            # not cls(**fields): __post_init__ would run again on fields it made (self.b = self.b * 2: twice)
            record: Any = object.__new__(cls)
            for name, value in fields.items():
                object.__setattr__(record, name, value)  # a frozen dataclass's too
            return record
        try:  # a container's own record (a ModelOutput, a dict too): built by its class, which fills the dict
            record = cls(**{k: v for k, v in fields.items() if k in init})
        except Exception:  # noqa: BLE001 - a __post_init__ checking its fields' types meets TensorSpecs
            record = cast(Any, cls).__new__(cls)
        for name, value in fields.items():
            if name not in init or getattr(record, name, None) is not value:
                object.__setattr__(record, name, value)
        return record

    pytree.register_pytree_node(cls, flatten, unflatten, flatten_with_keys_fn=flatten_with_keys)
    log.info("registered dataclass %s.%s as a pytree node (fields %s)", cls.__module__, cls.__qualname__, names)
