"""``@skippable`` layers whose generator ``forward`` stashes and pops skip tensors by name.

A skippable layer declares the names it stashes and pops; its ``forward`` is a generator::

    @skippable(stash=["1to3"])
    class Layer1(nn.Module):
        def forward(self, x):
            yield stash("1to3", x)
            return self.conv(x)

    @skippable(pop=["1to3"])
    class Layer3(nn.Module):
        def forward(self, x):
            skip = yield pop("1to3")
            return self.conv(x) + skip

``skippable`` turns the class into a :class:`Skippable` that holds an instance of it as
``.module`` (so state_dict keys read ``<layer>.module.conv.weight``, as with torchgpipe) and
runs the generator: it takes every declared pop from the current skip tracker
(:mod:`~fxpipe.compat.torchgpipe.skip.tracker`) before the generator starts, answers each
``yield pop(name)`` from them, and saves every ``yield stash(name, tensor)`` to the tracker
once the generator returns. Declarations are static, so a pipeline knows every route before
it runs (:mod:`~fxpipe.compat.torchgpipe.skip.layout`).
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn
from typing_extensions import Self

from fxpipe.compat.torchgpipe.skip.namespace import Namespace
from fxpipe.compat.torchgpipe.skip.tracker import current_skip_tracker

__all__ = ["Skippable", "pop", "skippable", "stash", "verify_skippables"]


class stash:
    """The command ``yield stash(name, tensor)``: hand ``tensor`` (or None) to the layer popping ``name``."""

    __slots__ = ("name", "tensor")

    def __init__(self, name: str, tensor: torch.Tensor | None) -> None:
        self.name = name
        self.tensor = tensor


class pop:
    """The command ``skip = yield pop(name)``: receive the tensor an earlier layer stashed as ``name``."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


class Skippable(nn.Module):
    """A layer with declared skips; made by :func:`skippable`, not used directly."""

    module_cls: ClassVar[type]
    stashable_names: ClassVar[frozenset[str]]
    poppable_names: ClassVar[frozenset[str]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.module = self.module_cls(*args, **kwargs)
        self.namespaces: dict[str, Namespace] = {}

    def __repr__(self) -> str:
        """Show the wrapped layer, marked as skippable."""
        return f"@skippable({self.module})"

    def namespaced(self, name: str) -> tuple[Namespace | None, str]:
        """Return ``(namespace, name)`` for a declared skip name (namespace None by default)."""
        return self.namespaces.get(name), name

    def stashable(self) -> Iterator[tuple[Namespace | None, str]]:
        """Iterate over the namespaced names this layer stashes."""
        return (self.namespaced(name) for name in sorted(self.stashable_names))

    def poppable(self) -> Iterator[tuple[Namespace | None, str]]:
        """Iterate over the namespaced names this layer pops."""
        return (self.namespaced(name) for name in sorted(self.poppable_names))

    def isolate(self, ns: Namespace, *, only: Iterable[str] | None = None) -> Self:
        """Put this layer's skips (or those named in ``only``) in namespace ``ns``; return the layer.

        Two stash/pop pairs may share a name in one model when each pair is isolated in a
        namespace of its own.
        """
        names = self.stashable_names | self.poppable_names if only is None else set(only)
        for name in names:
            self.namespaces[name] = ns
        return self

    def forward(self, input: Any) -> Any:
        """Run the layer's generator, popping from and stashing to the current skip tracker.

        Raises RuntimeError for a skip used but not declared, declared but not used, or
        popped but never stashed.
        """
        tracker = current_skip_tracker()
        poppable: dict[str, Any] = {}
        for ns, name in self.poppable():
            try:
                poppable[name] = tracker.load(ns, name)
            except KeyError:
                raise RuntimeError(f"'{name}' has not been stashed: no earlier layer stashed it "
                                   "(check the order of the layers and their namespaces)") from None
        stashed: dict[str, Any] = {}
        output = _drive(self.module(input), self._stasher(stashed), self._popper(poppable))
        unused = sorted(self.stashable_names - stashed.keys())
        if unused:
            raise RuntimeError(f"{', '.join(map(repr, unused))} must be stashed but have not: "
                               f"{type(self.module).__name__} declares them in stash= but its "
                               "forward never yields stash() for them")
        if poppable:
            raise RuntimeError(f"{', '.join(map(repr, sorted(poppable)))} must be popped but have "
                               f"not: {type(self.module).__name__} declares them in pop= but its "
                               "forward never yields pop() for them")
        for ns, name in self.stashable():
            tracker.save(ns, name, stashed[name])
        return output

    def _stasher(self, stashed: dict[str, Any]) -> Callable[[stash], None]:
        """Return the handler of ``yield stash(...)`` commands."""
        def handle(command: stash) -> None:
            """Keep a stashed tensor, refusing an undeclared name."""
            if command.name not in self.stashable_names:
                raise RuntimeError(f"'{command.name}' has not been declared as stashable; add it to "
                                   f"@skippable(stash=[...]) of {type(self.module).__name__}")
            stashed[command.name] = command.tensor
        return handle

    def _popper(self, poppable: dict[str, Any]) -> Callable[[pop], Any]:
        """Return the handler of ``yield pop(...)`` commands."""
        def handle(command: pop) -> Any:
            """Hand out a popped tensor, refusing an undeclared name."""
            if command.name not in self.poppable_names:
                raise RuntimeError(f"'{command.name}' has not been declared as poppable; add it to "
                                   f"@skippable(pop=[...]) of {type(self.module).__name__}")
            return poppable.pop(command.name)
        return handle


def _drive(result: Any, on_stash: Callable[[stash], None], on_pop: Callable[[pop], Any]) -> Any:
    """Run a generator forward to its return value, answering its stash/pop commands."""
    if not isinstance(result, types.GeneratorType):
        return result  # a forward without yield
    reply = None
    while True:
        try:
            command = result.send(reply)
        except StopIteration as stop:
            return stop.value
        if isinstance(command, stash):
            on_stash(command)
            reply = None
        elif isinstance(command, pop):
            reply = on_pop(command)
        else:
            raise TypeError(f"{command!r} is not a command from @skippable; yield stash(name, tensor) "
                            "or pop(name)")


def skippable(stash: Iterable[str] = (), pop: Iterable[str] = ()) -> Callable[[type], type[Skippable]]:
    """Declare the skip names a layer class stashes and pops; return the decorator.

    The decorated class becomes a :class:`Skippable` of the same name whose instances hold
    an instance of the original class as ``.module``. Each skip name needs exactly one
    stashing and one popping layer (per namespace): :func:`verify_skippables` checks it.
    """
    stashable_names, poppable_names = frozenset(stash), frozenset(pop)

    def decorate(module_cls: type) -> type[Skippable]:
        """Return the Skippable subclass wrapping ``module_cls``."""
        attrs = {"module_cls": module_cls, "stashable_names": stashable_names,
                 "poppable_names": poppable_names, "__module__": module_cls.__module__,
                 "__qualname__": module_cls.__qualname__, "__doc__": module_cls.__doc__}
        return type(module_cls.__name__, (Skippable,), attrs)

    return decorate


def verify_skippables(module: nn.Sequential) -> None:
    """Check that every skip of ``module``'s layers has one stash and one later pop.

    Raises TypeError listing every name stashed twice, popped twice, popped before (or
    without) a stash, stashed and never popped, or both stashed and popped by one layer,
    unless isolated in different namespaces.
    """
    stashed: set[tuple[Namespace | None, str]] = set()
    popped: set[tuple[Namespace | None, str]] = set()
    problems: list[str] = []
    for layer_name, layer in module.named_children():
        if not isinstance(layer, Skippable):
            continue
        both = layer.stashable_names & layer.poppable_names
        problems += [f"'{layer_name}' declared '{name}' both as stashable and as poppable"
                     for name in sorted(both)]
        for key in layer.stashable():
            if key[1] in both:
                continue
            if key in stashed:
                problems.append(f"'{layer_name}' redeclared '{key[1]}' as stashable but not isolated "
                                "by namespace")
            stashed.add(key)
        for key in layer.poppable():
            if key[1] in both:
                continue
            if key in popped:
                problems.append(f"'{layer_name}' redeclared '{key[1]}' as poppable but not isolated "
                                "by namespace")
            elif key not in stashed:
                problems.append(f"'{layer_name}' declared '{key[1]}' as poppable but it was not stashed")
            else:
                popped.add(key)
    problems += [f"no module declared '{name}' as poppable but stashed"
                 for _, name in sorted(stashed - popped, key=lambda k: k[1])]
    if problems:
        raise TypeError("one or more pairs of stash and pop do not match:\n\n"
                        + "\n".join(f"* {p}" for p in problems)
                        + "\n\nGive each skip name one stashing layer and one later popping layer, "
                        "or isolate pairs that share a name with Skippable.isolate(Namespace())")
