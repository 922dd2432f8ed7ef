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
from typing import Any

import torch.fx
from torch.utils import _pytree as pytree

__all__ = ["register_graph_records", "register_record_type", "register_records"]

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
        if node.op == "call_function" and isinstance(node.target, type) and dataclasses.is_dataclass(node.target):
            register_record_type(node.target)


def register_record_type(cls: type) -> None:
    """Register one dataclass type, unless torch's pytree knows it already."""
    if cls in pytree.SUPPORTED_NODES:
        return
    names = [f.name for f in dataclasses.fields(cls)]  # init=False ones too (set by __post_init__)

    def present(obj: Any) -> tuple[str, ...]:
        """Return the fields ``obj`` holds (an ``init=False`` one may be unset)."""
        return tuple(n for n in names if hasattr(obj, n))

    def flatten(obj: Any) -> tuple[list[Any], Any]:
        held = present(obj)
        return [getattr(obj, n) for n in held], held

    def flatten_with_keys(obj: Any) -> tuple[list[tuple[Any, Any]], Any]:
        held = present(obj)
        return [(pytree.GetAttrKey(n), getattr(obj, n)) for n in held], held

    init = {f.name for f in dataclasses.fields(cls) if f.init}

    def unflatten(values: Any, context: Any) -> Any:
        fields = dict(zip(context, values))
        if not issubclass(cls, (dict, list, tuple)):
            # not cls(**fields): __post_init__ would run again on fields it made (self.b = self.b * 2: twice)
            record: Any = object.__new__(cls)
            for name, value in fields.items():
                object.__setattr__(record, name, value)  # a frozen dataclass's too
            return record
        try:  # a container's own record (a ModelOutput, a dict too): built by its class, which fills the dict
            record = cls(**{k: v for k, v in fields.items() if k in init})
        except Exception:  # noqa: BLE001 - a __post_init__ checking its fields' types meets TensorSpecs
            record = cls.__new__(cls)  # type: ignore[type-var]
        for name, value in fields.items():
            if name not in init or getattr(record, name, None) is not value:
                object.__setattr__(record, name, value)
        return record

    pytree.register_pytree_node(cls, flatten, unflatten, flatten_with_keys_fn=flatten_with_keys)
    log.info("registered dataclass %s.%s as a pytree node (fields %s)", cls.__module__, cls.__qualname__, names)
