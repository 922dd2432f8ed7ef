"""Tell when a model was changed after compile in a way the pipe does not follow.

The pipe runs the graph traced at compile. It follows what lives in tensors and in the
modules it calls (parameters' values, a replaced ``Parameter``, ``train()``/``eval()``,
``requires_grad``, a leaf module's own attributes such as ``Dropout.p`` under fx), but not:

    a submodule replaced or removed    the graph calls the module of compile (the new one's
                                       parameters get no gradient)
    a plain attribute the trace read   a flag or a scale (``self.use_relu``, ``self.scale``,
                                       PEFT's adapter switches) keeps its value of compile
    a submodule's own train()/eval()   where its traced code reads the mode (a dropout's flag,
                                       an exported batch norm), the merged graph reads the
                                       whole model's

:func:`snapshot` records, at compile, each module's place in its parent and, for each module
whose code the graph was traced through (not one it calls whole, nor those beneath such a
one, nor an alias of such a one), its plain attributes (bools, numbers, numpy numbers, strings, enums, None,
containers of up to 64 of them; private ones too; its class's public defaults; functions and
public tensors by identity): which of them the code reads is not known, so
a counter kept on the model is told once too. :func:`changes` names what differs at a call
(a dict's added keys and a list of numbers grown at its end are not a difference). It records
the tensors the stages fetch themselves (``get_attr``: a parameter used directly, every weight
under torch.export or zero bubble) too: :func:`replaced` tells one replaced on the model
(``model.load_state_dict(sd, assign=True)``, ``model.gain = nn.Parameter(...)``), and the pipe
then points its stages at the new tensors before the call.
"""

from __future__ import annotations

import copy
import enum
import functools
import types
from collections.abc import Sequence
from typing import Any

import torch.fx
from torch import nn

from fxpipe.runtime.stage.reshare import held_tensor, tensor_place

__all__ = ["Snapshot", "changes", "describe", "replaced", "snapshot", "untied"]

_PLAIN = (bool, int, float, str, type(None))
_CONTAINERS = (list, tuple, dict, set, frozenset)
_MODULE_OWN = frozenset(vars(nn.Module())) | {"training", "forward"}  # hooks' registries and the like
_FUNCTIONS = (types.FunctionType, types.BuiltinFunctionType, functools.partial)


class _Missing:
    """Stands for a submodule or an attribute deleted since the snapshot."""


class Snapshot:
    """Each submodule's place in its parent and the plain attributes its traced code may read, at compile."""

    def __init__(self, model: nn.Module, gm: torch.fx.GraphModule, runs: Sequence[torch.fx.GraphModule] = (),
                 stages: Sequence[torch.fx.GraphModule] = ()) -> None:
        called = {str(n.target) for n in gm.graph.nodes if n.op == "call_module"}
        whole = [m for m in (_module(model, c) for c in called) if m is not None]
        under_called = {id(m) for w in whole for m in w.modules()}  # aliases too (a shared dropout)
        # (the parent's registry, the key, the module, its name): a registry changes in place on setattr
        self.places: list[tuple[Any, str, nn.Module, str]] = []
        # (the module, the attribute, its value, the module's name): the module, not its __dict__, which a
        # deepcopy of the pipe would copy apart from the copied module's own
        self.values: list[tuple[nn.Module, str, Any, str]] = [(model, k, v, "") for k, v in _plain(model)]
        for name, parent in model.named_modules():
            for key, child in parent._modules.items():
                if child is None:
                    continue
                full = f"{name}.{key}" if name else key
                self.places.append((parent._modules, key, child, full))
                if id(child) not in under_called:  # a module the graph calls
                    self.values += [(child, k, v, full) for k, v in _plain(child)]  # runs its own code: followed
        # (the module, its name, its mode against the model's) of each module whose code the merged graph runs by
        # the whole model's mode: its own train()/eval() after compile is not followed
        self.model = model
        self.moded = [(module, path, module.training == model.training) for path, module in _moded(model, gm)]
        # (the module, the field, its tensor) of each tensor the graph fetches (get_attr): the stages hold them
        # in attributes of their own, which a replaced Parameter (load_state_dict(assign=True)) leaves behind
        self.fetched: list[tuple[nn.Module, str, Any]] = []
        for target in sorted({str(n.target) for g in (gm, *runs) for n in g.graph.nodes if n.op == "get_attr"}):
            place = tensor_place(model, target)
            tensor = None if place is None else held_tensor(*place)
            if place is not None and tensor is not None:
                self.fetched.append((*place, tensor))
        # (the module, the field, its name, the name the stages fetch) of each other place of a tensor they fetch
        # (a tie) that only the fetch reads: a tie undone there leaves the stages reading one tensor for both
        self.ties: list[tuple[nn.Module, str, str, str]] = _ties(model, [*stages, *runs] if stages else [gm, *runs])

    def retake(self) -> None:
        """Record the tensors the graph fetches as they are now (after the stages were pointed at them)."""
        self.fetched = [(owner, field, held_tensor(owner, field)) for owner, field, _ in self.fetched]


def _module(model: nn.Module, target: str) -> nn.Module | None:
    """Return the submodule ``target`` names, or None where the model has none by that name."""
    try:
        return model.get_submodule(target)
    except AttributeError:
        return None


def _moded(model: nn.Module, gm: torch.fx.GraphModule) -> list[tuple[str, nn.Module]]:
    """Return the submodules (name, module) owning a node of ``gm`` that reads the mode (``pick``, a dropout's flag)."""
    found: dict[str, nn.Module] = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr" or node.target != "training":
            continue
        for user in node.users:
            stack = user.meta.get("nn_module_stack") or next(
                (a.meta.get("nn_module_stack") for a in user.all_input_nodes if a.meta.get("nn_module_stack")), None)
            path = list(stack.values())[-1][0] if stack else ""
            module = _module(model, path) if path else None
            if module is not None:
                found[path] = module
    return sorted(found.items())


def _ties(model: nn.Module, graphs: Sequence[torch.fx.GraphModule]) -> list[tuple[nn.Module, str, str, str]]:
    """Return (module, field, name, fetched name) of each place sharing a tensor ``graphs`` fetch that they read no
    other way (by that name, or through a module they call)."""
    names = {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "get_attr"}
    called = {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_module"}
    targets: dict[int, str] = {}
    for target in sorted(names):
        place = tensor_place(model, target)
        tensor = None if place is None else held_tensor(*place)
        if tensor is not None:
            targets.setdefault(id(tensor), target)
    found = []
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        prefix, _, field = name.rpartition(".")
        if id(t) not in targets or name in names or any(prefix == c or prefix.startswith(c + ".") for c in called):
            continue
        found.append((model.get_submodule(prefix) if prefix else model, field, name, targets[id(t)]))
    return found


def untied(snap: Snapshot) -> list[tuple[str, str]]:
    """Return (name, fetched name) of each tie the graph reads as one tensor that was undone on the model."""
    found = []
    for owner, field, name, of in snap.ties:
        place = tensor_place(snap.model, of)
        if held_tensor(owner, field) is not (None if place is None else held_tensor(*place)):
            found.append((name, of))
    return found


def replaced(snap: Snapshot) -> bool:
    """Tell whether a tensor the graph fetches was replaced on the model by another object since the snapshot."""
    return any(held_tensor(owner, field) is not tensor for owner, field, tensor in snap.fetched)


def _is_plain(value: Any, depth: int = 0) -> bool:
    """Tell whether ``value`` is a bool, number, string or None, or a small container of them (a scale per adapter)."""
    if type(value) in _PLAIN or isinstance(value, enum.Enum) or _numpy_scalar(value):
        return True
    if depth > 2 or type(value) not in _CONTAINERS or len(value) > 64:
        return False
    items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
    return all(_is_plain(v, depth + 1) for v in items)


def _numpy_scalar(value: Any) -> bool:
    """Tell whether ``value`` is a numpy scalar (``np.sqrt(d)``, ``np.int64(3)``): a number to traced code."""
    return type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0


def _watched(key: str, value: Any) -> bool:
    """Tell whether attribute ``key`` holding ``value`` may steer traced code: plain, private ones too.

    Private attributes hold switches (PEFT's ``_disable_adapters`` and ``_active_adapter``) and
    scales as public ones do; nn.Module's own registries are not the model's code. A function
    (``self.act = F.tanh``) and a public tensor that is not a parameter or buffer
    (``self.temperature = torch.tensor(2.0)``) the trace took as it was are watched by identity:
    another one put in their place is not followed (a private tensor is a cache's own).
    """
    if key in _MODULE_OWN or key.startswith("__"):
        return False
    if isinstance(value, _FUNCTIONS) or (isinstance(value, torch.Tensor) and not key.startswith("_")):
        return True
    return _is_plain(value)


def _plain(module: nn.Module) -> list[tuple[str, Any]]:
    """Return the module's plain attributes (:func:`_watched`; containers copied), its class's public ones too.

    A class's default (``gradient_checkpointing = False`` on the class) is what the traced code
    read until the instance sets its own.
    """
    found = {k: v for k, v in vars(module).items() if _watched(k, v)}
    for cls in type(module).__mro__:
        if cls in (nn.Module, object):
            break
        for k in vars(cls):
            if k not in found and k not in vars(module) and not k.startswith("_"):
                v = getattr(type(module), k, _Missing)  # as the class resolves it (a subclass's own first)
                if type(v) in _PLAIN:
                    found[k] = v
    return [(k, copy.deepcopy(v) if type(v) in _CONTAINERS else v) for k, v in found.items()]


def _now(module: nn.Module, key: str) -> Any:
    """Return what the traced code would read as ``module.key`` now: the instance's, else its class's."""
    held = module.__dict__
    return held[key] if key in held else getattr(type(module), key, _Missing)


def snapshot(model: nn.Module, gm: torch.fx.GraphModule, runs: Sequence[torch.fx.GraphModule] = (),
             stages: Sequence[torch.fx.GraphModule] = ()) -> Snapshot:
    """Record each submodule's place, the plain attributes its traced code may read, the tensors ``gm`` and ``runs``
    fetch, and the ties ``stages`` and ``runs`` read as one tensor."""
    return Snapshot(model, gm, runs, stages)


def _get(registry: Any, key: str) -> Any:
    """Return ``registry[key]`` (a ScriptModule's registry has no ``get``), or the missing marker."""
    try:
        return registry[key]
    except KeyError:
        return _Missing


def changes(snap: Snapshot) -> list[str]:
    """Name each submodule replaced or removed, and each recorded attribute changed, since the snapshot."""
    root = snap.model
    modes = [
        f"{name} was put in {'training' if m.training else 'eval'} mode on its own (the model is in "
        f"{'training' if root.training else 'eval'} mode)" for m, name, same in snap.moded
        if (m.training == root.training) != same]
    if all(_get(r, k) is m for r, k, m, _ in snap.places) and not modes and \
            all(_kept(k, _now(m, k), v) for m, k, v, _ in snap.values):
        return []
    found = [f"{name} was {'removed' if _get(r, k) in (None, _Missing) else 'replaced'}"
             for r, k, m, name in snap.places if _get(r, k) is not m]
    found += [f"{name + '.' if name else ''}{k} was {_short(v)}, is {_short(_now(m, k))}"
              for m, k, v, name in snap.values if not _kept(k, _now(m, k), v)]
    return found + modes


def _kept(key: str, now: Any, then: Any) -> bool:
    """Tell whether attribute ``key`` holds what it held (:func:`_same`), a private None given a function counting so.

    diffusers keeps ``_gradient_checkpointing_func`` None until checkpointing is turned on: the
    pipe checkpoints by its own options.
    """
    return _same(now, then) or key.startswith("_") and then is None and not _is_plain(now) and now is not _Missing


def _same(now: Any, then: Any) -> bool:
    """Tell whether an attribute holds what it held, as far as traced code can tell.

    Equal; or one value and a list or tuple of it alone (PEFT keeps its active adapter as
    ``['default']`` or ``'default'`` by the call that set it); or a dict holding the same values
    under the keys it had (PEFT's ``scaling`` given a key for an added adapter); or a list of
    numbers that grew after what it held (a history kept on the model).
    """
    if now is then:
        return True
    if isinstance(now, (torch.Tensor, *_FUNCTIONS)) or isinstance(then, (torch.Tensor, *_FUNCTIONS)):
        return False  # by identity (a tensor's == is elementwise)
    if now == then:
        return True
    if isinstance(now, dict) and isinstance(then, dict):
        return all(k in now and _same(now[k], v) for k, v in then.items())
    if isinstance(now, list) and isinstance(then, list) and len(now) > len(then) and now[:len(then)] == then:
        return not any(isinstance(v, str) for v in now)  # names (merged adapters) steer the code: not bookkeeping
    one = [(a, b) for a, b in ((now, then), (then, now)) if type(a) in (list, tuple) and len(a) == 1]
    return any(a[0] == b for a, b in one)


def _short(value: Any) -> str:
    """Return ``repr(value)``, cut to 80 characters."""
    text = "(deleted)" if value is _Missing else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def describe(found: list[str]) -> str:
    """Return the warning for the changes ``found``."""
    return (f"the model changed after fxpipe.compile: {'; '.join(found[:5])}{' ...' if len(found) > 5 else ''}. "
            "The pipe runs the graph traced at compile: a replaced submodule is not called (its parameters get no "
            "gradient), an attribute the traced code read keeps its value of compile, and the traced code of a "
            "submodule runs by the whole model's mode, not its own (a batch norm or dropout set apart with "
            "model.part.eval() keeps the model's). Compile the model again after changing it, with the submodule's "
            "mode set first (parameters' values, a replaced Parameter, the whole model's train()/eval() and "
            "requires_grad are followed)")
