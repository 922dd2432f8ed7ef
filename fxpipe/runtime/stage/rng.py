"""What a recomputation replays of its first forward: the random number generators' state, autocast.

A recomputation in backward draws the same random numbers as the forward it repeats (dropout
keeps its mask) and computes in the same precision: :func:`save_rng` and :func:`autocast_state`
capture both before the forward, :func:`restore_rng` and :func:`autocast_as` put them back
around the recomputation (and, for the RNG, restore the state from before it afterwards).
Besides the default generators, a stage replays the model's own ``torch.Generator`` objects its
graph draws from (``torch.bernoulli(p, generator=self.gen)``): :func:`stage_generators`, and
those a call is given as inputs (``model(x, gen)``): :func:`with_inputs`.

A stage on a GPU replays its GPU's generator and the CPU's, except in one process whose
pipe also runs stages on the CPU (``replay_cpu=False``): there the GPU stage's forward and
recomputation run on that GPU's thread (the device threads, autograd's device thread) while
the CPU stage draws from the CPU's generator on another, and setting the CPU's state from the
GPU's thread changed the masks the CPU stage drew (seen on an H200 with
``devices=["cuda:0", "cpu"]``). Such a GPU stage's draws on the CPU are not replayed.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.fx

__all__ = ["RngState", "autocast_as", "autocast_off", "autocast_state", "filled_cell", "held", "held_generators",
           "restore_rng", "same_rng", "save_rng", "stage_generators", "user_functions", "with_inputs"]


# (the CPU's, the CUDA device's), None if not kept; then each own generator of the stage with its state
RngState = tuple[torch.Tensor | None, torch.Tensor | None, tuple[tuple[torch.Generator, torch.Tensor], ...]]


def stage_generators(gm: torch.fx.GraphModule) -> tuple[torch.Generator, ...]:
    """Return the ``torch.Generator`` objects ``gm``'s nodes draw from (attributes, constants, leaf modules' own)."""
    found: dict[int, torch.Generator] = {}
    for node in gm.graph.nodes:
        values: list[Any] = []
        if node.op == "get_attr":
            with contextlib.suppress(AttributeError):  # an attribute the stage does not hold
                values.append(operator.attrgetter(str(node.target))(gm))
        elif node.op == "call_module":  # a module called whole (a leaf) drawing from a generator it holds
            with contextlib.suppress(AttributeError):
                values += [g for m in gm.get_submodule(str(node.target)).modules() for g in held_generators(m)]
        torch.fx.node.map_aggregate((node.args, node.kwargs), values.append)
        found.update((id(v), v) for v in values if isinstance(v, torch.Generator))
    return tuple(found.values())


def held_generators(value: Any) -> list[torch.Generator]:
    """Return the ``torch.Generator`` objects ``value`` is or holds, up to 6 references deep.

    Looked into: lists, tuples, sets and dicts; a user object's attributes and ``__slots__``
    (a sampler, a callable one too); a function's closure, defaults and bound ``self``; a
    ``functools.partial``'s function and arguments; a module's attributes (not its submodules,
    parameters or buffers: the caller walks those). Not fxpipe's own objects (a pipe a loss_fn's
    trainer holds, the binding a micro-batch's loss closes over).
    """
    return held(value, torch.Generator)


def held(value: Any, kind: type) -> list[Any]:
    """Return the objects of ``kind`` that ``value`` is or holds (see :func:`held_generators`)."""
    found: dict[int, Any] = {}
    _walk(value, kind, 0, found, set())
    return list(found.values())


def user_functions(value: Any) -> list[types.FunctionType]:
    """Return the functions ``value`` is or holds (see :func:`held_generators`) that are not fxpipe's own wrappers."""
    return [f for f in held(value, types.FunctionType) if not f.__module__.startswith("fxpipe.")]


def _walk(value: Any, kind: type, depth: int, found: dict[int, Any], seen: set[int]) -> None:
    """Add the objects of ``kind`` that ``value`` holds to ``found``."""
    if type(value).__module__.startswith("fxpipe."):
        return  # fxpipe's own objects (a pipe, the binding a micro-batch's loss closes over): not the user's
    if isinstance(value, kind):
        found[id(value)] = value
    if depth > 6 or id(value) in seen or len(seen) > 4096 or value is None or \
            isinstance(value, (torch.Generator, torch.Tensor, str, bytes, type, int, float, complex, bool)):
        return
    seen.add(id(value))
    for item in _references(value)[:64]:
        _walk(item, kind, depth + 1, found, seen)


def _references(value: Any) -> list[Any]:
    """Return what ``value`` refers to that may hold a generator."""
    if isinstance(value, (list, tuple, set, frozenset)):
        return list(value)
    if isinstance(value, dict):
        return list(value.values())
    if isinstance(value, functools.partial):
        return [value.func, *value.args, *value.keywords.values()]
    if isinstance(value, types.MethodType):
        return [value.__self__, value.__func__]
    if isinstance(value, types.FunctionType):
        cells = [c.cell_contents for c in value.__closure__ or () if filled_cell(c)]
        return cells + list(value.__defaults__ or ()) + list((value.__kwdefaults__ or {}).values())
    if isinstance(value, torch.nn.Module):
        return [v for k, v in vars(value).items() if not k.startswith("_")]
    if type(value).__module__ == "builtins" or isinstance(value, types.ModuleType):
        return []
    held = list(getattr(value, "__dict__", {}).values())
    for cls in type(value).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        held += [getattr(value, n) for n in ([slots] if isinstance(slots, str) else slots) if hasattr(value, n)]
    return held


def filled_cell(cell: Any) -> bool:
    """Tell whether a closure cell holds a value (a variable assigned later may not yet)."""
    try:
        _ = cell.cell_contents
    except ValueError:
        return False
    return True


def with_inputs(generators: tuple[torch.Generator, ...], inputs: Any) -> tuple[torch.Generator, ...]:
    """Return ``generators`` and the ``torch.Generator`` objects among a call's ``inputs`` (nested too)."""
    given = [v for v in torch.utils._pytree.tree_leaves(inputs) if isinstance(v, torch.Generator)]
    if not given:
        return generators
    return tuple({id(g): g for g in (*generators, *given)}.values())


def save_rng(device: torch.device, replay_cpu: bool = True,
             generators: tuple[torch.Generator, ...] = ()) -> RngState:
    """Capture the RNG state of ``device`` if it is a CUDA device, the CPU's unless ``replay_cpu`` is False, and ``generators``'."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    own = tuple((g, g.get_state()) for g in generators)
    return (torch.get_rng_state() if replay_cpu or cuda is None else None), cuda, own


def same_rng(a: RngState, b: RngState) -> bool:
    """Tell whether two captured RNG states are equal (no random number was drawn between them)."""
    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
               for x, y in zip(a[:2], b[:2])) and all(
        torch.equal(x, y) for (_, x), (_, y) in zip(a[2], b[2]))


@contextmanager
def restore_rng(device: torch.device, state: RngState) -> Iterator[None]:
    """Run the block with a saved RNG state, then put back the state from before."""
    cpu, cuda, own = state
    with contextlib.ExitStack() as stack:
        if cpu is not None:
            stack.enter_context(torch.random.fork_rng(devices=[]))
            torch.set_rng_state(cpu)
        if cuda is not None:
            stack.callback(torch.cuda.set_rng_state, torch.cuda.get_rng_state(device), device)
            torch.cuda.set_rng_state(cuda, device)
        for generator, saved in own:
            stack.callback(generator.set_state, generator.get_state())
            generator.set_state(saved)
        yield


def autocast_state() -> tuple[tuple[str, bool, torch.dtype], ...]:
    """Return what autocast does now, on CPU and CUDA: ``(device type, enabled, dtype)`` each."""
    return tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda"))


@contextmanager
def autocast_as(state: tuple[tuple[str, bool, torch.dtype], ...]) -> Iterator[None]:
    """Run the block under a saved autocast state (another thread's, or a forward's for its recompute).

    Its casts are not cached: under one ``torch.autocast`` around ``pipe.step`` a micro-batch would
    reuse an earlier one's cast of a weight, whose autograd node FSDP2's post-backward hook of a
    later stage input has passed by then: that micro-batch's weight gradient was dropped.
    """
    with contextlib.ExitStack() as stack:
        for device_type, enabled, dtype in state:
            if enabled or torch.is_autocast_enabled(device_type):
                stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=False))
        yield


def autocast_off() -> contextlib.AbstractContextManager[None]:
    """Return a context running a backward outside the caller's autocast, as eager's ``loss.backward()`` runs.

    ``pipe.step`` runs forward and backward in one call, under the ``torch.autocast`` around it:
    a backward under it would cast the backward of a block the forward kept in float32
    (``torch.autocast(enabled=False)`` inside) to the low precision, where eager's does not.
    """
    return autocast_as(tuple((d, False, dtype) for d, _, dtype in autocast_state()))
