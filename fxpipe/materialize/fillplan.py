"""Decide how each tensor of a model gets its values, and refuse what cannot work, reading no data.

    every parameter and buffer ──▶ from the weights source (under any of its FQNs)
                               └─▶ by init (it is on meta and the source lacks it): by its recipe
                                   if it was made under ``fxpipe.deferred_init()``, then by init=
                                   if given; else by init= or its module's ``reset_parameters()``
                               └─▶ left as it is (it is real and nothing replaces it)

Refusals name the FQNs: a source lacking a persistent tensor (when no ``init=`` is given; a
batch norm's ``num_batches_tracked``, absent from old checkpoints, is initialised as torch does), a
shape or dtype that differs, a module with a tensor to initialise but neither ``init=`` nor
a ``reset_parameters()``; a non-persistent buffer (never in a checkpoint) in such a module
gets its own message. Source keys that name no tensor of the model are warned about.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from fxpipe.errors import WeightsError
from fxpipe.materialize.recipes import Recipe, recipe_of
from fxpipe.materialize.weights import WeightSource

__all__ = ["FillPlan", "Slot", "TensorInfo", "plan_fill", "tensor_table"]

_SHOWN = 10  # names listed in one message


@dataclass
class Slot:
    """One place a module holds a tensor: ``module._parameters[name]`` or ``module._buffers[name]``."""

    module: nn.Module
    registry: str  # "_parameters" or "_buffers"
    name: str
    fqn: str

    def get(self) -> torch.Tensor | None:
        """Return the tensor in this place now."""
        return getattr(self.module, self.registry).get(self.name)

    def set(self, tensor: torch.Tensor) -> None:
        """Put ``tensor`` back in this place."""
        getattr(self.module, self.registry)[self.name] = tensor


@dataclass
class TensorInfo:
    """A parameter or buffer: every FQN and place it has, and whether checkpoints hold it."""

    tensor: torch.Tensor
    names: list[str] = field(default_factory=list)
    slots: list[Slot] = field(default_factory=list)
    persistent: bool = False


@dataclass
class FillPlan:
    """Which tensors come from the source (id -> source key), which from init, by which modules."""

    from_source: dict[int, str]
    to_init: set[int]
    modules: list[tuple[str, nn.Module, list[int]]]  # (FQN, module, ids of its own tensors), model order
    recipes: dict[int, Recipe] = field(default_factory=dict)  # the to_init tensors deferred_init recorded


def tensor_table(model: nn.Module) -> dict[int, TensorInfo]:
    """Return ``id(tensor) -> TensorInfo`` for every parameter and buffer, FQNs in model order."""
    table: dict[int, TensorInfo] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = prefix + "." if prefix else ""
        for registry in ("_parameters", "_buffers"):
            for name, t in getattr(module, registry).items():
                if t is None:
                    continue
                info = table.setdefault(id(t), TensorInfo(t))
                info.names.append(dot + name)
                info.slots.append(Slot(module, registry, name, dot + name))
                if registry == "_parameters" or name not in module._non_persistent_buffers_set:
                    info.persistent = True
    return table


def _counter(info: TensorInfo) -> bool:
    """Tell a batch norm's ``num_batches_tracked``: checkpoints before PyTorch 0.4.1 lack it (init zeroes it)."""
    return any(isinstance(s.module, _BatchNorm) and s.name == "num_batches_tracked" for s in info.slots)


def _own_keys(module: nn.Module) -> list[int]:
    """Return the ids of a module's own (not its children's) parameters and buffers."""
    return [id(t) for reg in (module._parameters, module._buffers) for t in reg.values() if t is not None]


def plan_fill(model: nn.Module, table: dict[int, TensorInfo], source: WeightSource | None,
              init: Callable[[nn.Module], Any] | None, leave: bool = False) -> FillPlan:
    """Decide each tensor's source; raise :class:`WeightsError` for what no step could fill.

    ``leave``: a tensor the source lacks stays as it is, on meta or not (loading a checkpoint
    into a pipe: non-persistent buffers, and other ranks' tensors, are none of its business).
    """
    known = {n for info in table.values() for n in info.names}
    if source is not None:
        source.fit(known)
    specs = source.specs() if source is not None else {}
    unexpected = sorted(repr(k) for k in specs if k not in known)
    if unexpected:
        warnings.warn(f"{source.description} holds {len(unexpected)} key(s) that name no parameter or "  # type: ignore[union-attr]
                      f"buffer of {type(model).__name__}, ignored: {_show(unexpected)}", stacklevel=3)
    from_source: dict[int, str] = {}
    to_init: set[int] = set()
    missing, mismatched = [], []
    for key, info in table.items():
        hit = next((n for n in info.names if n in specs), None)
        if hit is not None:
            shape, dtype = specs[hit]
            if shape != tuple(info.tensor.shape):
                mismatched.append(f"'{hit}' has shape {shape} there but {tuple(info.tensor.shape)} in the model")
            elif dtype != info.tensor.dtype:
                mismatched.append(f"'{hit}' has dtype {dtype} there but {info.tensor.dtype} in the model")
            from_source[key] = hit
        elif source is not None and info.persistent and init is None and not _counter(info):
            missing.append(repr(info.names[0]))
        elif info.tensor.is_meta and not leave:
            to_init.add(key)
    if mismatched:
        cast = (" or, for another dtype, cast the model to it first (model.to(dtype) works on meta)"
                if any(" has dtype " in m for m in mismatched) else "")
        raise WeightsError(f"{source.description} does not fit the model: {'; '.join(mismatched[:_SHOWN])}"  # type: ignore[union-attr]
                           f"{_more(mismatched)}. Give weights saved from this model (same shapes and dtypes){cast}")
    if missing:
        renamed = (f"; it holds {len(unexpected)} other key(s) ({_show(unexpected)}), so it names the tensors "
                   "in another layout (transformers 5 saves some models, Mixtral's experts among them, in an "
                   "older layout that from_pretrained converts at load): give weights= a state dict under the "
                   "model's own names (from_pretrained(...).state_dict(), or your own mapping)") if unexpected else ""
        raise WeightsError(f"{source.description} lacks {len(missing)} FQN(s) of the model: {_show(missing)}{renamed}; "  # type: ignore[union-attr]
                           "give a source that holds them, or init= to initialise what it lacks")
    modules = [(fqn, m, keys) for fqn, m, keys in ((f, m, _own_keys(m)) for f, m in model.named_modules())
               if any(k in to_init for k in keys)]
    recipes = {key: r for key in to_init if (r := recipe_of(table[key].tensor)) is not None}
    if init is None:
        _check_init_paths(table, to_init - recipes.keys(), modules, deferred=bool(recipes))
        outside = [repr(info.names[0]) for k, info in table.items() if k in to_init and k not in recipes]
        if recipes and outside:
            warnings.warn(f"{len(outside)} meta tensor(s) of a model built under fxpipe.deferred_init() were not "
                          f"made inside it (made outside, or replaced after it, as model.to(dtype) does): "
                          f"{_show(outside)}; their modules' reset_parameters() fill them, not the values "
                          "__init__ gave", stacklevel=3)
    return FillPlan(from_source, to_init, modules, recipes)


_CAST = (" (a model built under fxpipe.deferred_init() and then cast or moved, as model.to(dtype) does, holds new "
         "tensors the context did not record: cast inside the context, or set the default dtype before building)")


def _check_init_paths(table: dict[int, TensorInfo], pending: set[int],
                      modules: list[tuple[str, nn.Module, list[int]]], deferred: bool = False) -> None:
    """Refuse modules whose meta tensors neither weights, a recipe nor a ``reset_parameters()`` fill."""
    stuck = [(fqn, m, ks) for fqn, m, keys in modules if (ks := [k for k in keys if k in pending])
             and not callable(getattr(m, "reset_parameters", None))]
    if not stuck:
        return
    if deferred:  # part of the model was recorded: these tensors were made or replaced outside the context
        raise WeightsError(
            f"{_show([repr(table[k].names[0]) for _, _, ks in stuck for k in ks])} were not made under "
            "fxpipe.deferred_init(), though other tensors of the model were (made on meta outside it, or "
            "replaced after it, e.g. by model.to(dtype), which makes new tensors): run that code inside the "
            "context, pass weights= or init= for them, or give their modules a reset_parameters()")
    hidden = [repr(table[k].names[0]) for _, _, keys in stuck for k in keys if not table[k].persistent]
    if hidden:
        raise WeightsError(
            f"buffer(s) {_show(hidden)} are not persistent, so no checkpoint holds them, and their "
            "module has no reset_parameters() to compute them; pass init= a function init(module) that "
            "sets them (it runs on each module a stage owns, after allocation), give the module a "
            "reset_parameters(), or build the model under fxpipe.deferred_init(), which records them" + _CAST)
    listed = [f"{repr(fqn) if fqn else 'the root module'} ({type(m).__name__}: "
              f"{', '.join(table[k].names[0] for k in keys)})" for fqn, m, keys in stuck]
    raise WeightsError(
        f"the model is on meta and {len(stuck)} module(s) hold tensors that neither weights= nor an init "
        f"fills (they have no reset_parameters()): {_show(listed)}; pass weights= holding them, init= a "
        "function init(module) that fills them, give those modules a reset_parameters(), or build the "
        "model under fxpipe.deferred_init(), which records the values its __init__ gives them" + _CAST)


def _show(names: list[str]) -> str:
    """List at most ``_SHOWN`` names, saying how many more there are."""
    return ", ".join(names[:_SHOWN]) + _more(names)


def _more(names: list[str]) -> str:
    """Say how many names were not listed."""
    return f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
