"""Namespaces that keep apart skips of the same name declared by different layer pairs."""

from __future__ import annotations

import uuid
from typing import Any

__all__ = ["Namespace"]


class Namespace:
    """A namespace for :meth:`Skippable.isolate`: equal only to itself and its copies."""

    __slots__ = ("id",)

    def __init__(self) -> None:
        self.id = uuid.uuid4()

    def __repr__(self) -> str:
        """Show the namespace's id."""
        return f"<Namespace '{self.id}'>"

    def __hash__(self) -> int:
        """Hash by id."""
        return hash(self.id)

    def __eq__(self, other: object) -> bool:
        """Tell whether ``other`` is this namespace or a copy of it."""
        return isinstance(other, Namespace) and other.id == self.id

    def __lt__(self, other: Any) -> bool:
        """Order namespaces by id (arbitrary but stable), so routes can be sorted."""
        return isinstance(other, Namespace) and self.id < other.id


def namespace_key(ns: Namespace | None) -> str:
    """Return a sort key for a namespace or the default namespace ``None``."""
    return "" if ns is None else str(ns.id)
