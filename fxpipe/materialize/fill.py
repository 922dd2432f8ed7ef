"""Give a model built on ``meta`` real tensors: only the ones asked for, filled by FQN or seeded init.

    plan     every tensor to fill: from the weights source (by any of its FQNs) or by init;
             refuse a missing FQN, a shape or dtype mismatch, a module with no init path
    alloc    the asked tensors, empty, on their devices (swapped in: every holder sees them)
    replay   those made under ``fxpipe.deferred_init()``: their recorded recipes (:mod:`fxpipe.materialize.recipes`),
             seeded from (seed, module FQN); before init= (which wins), after reset_parameters()
    init     each module holding one, in the model's order (a tied tensor's first holder after
             the others: its init wins, as in eager), seeded from (seed, module FQN)
    read     the asked FQNs from the source, nothing else
    verify   every tensor init had to fill was written; else name it

A failure at any point swaps every allocated tensor back to ``meta``: the model is as it was.
Tensors keep their identity (:func:`torch.utils.swap_tensors`), so the traced graph and the
stage GraphModules, which hold the model's own parameter objects, see the real ones.

Seeding per module FQN makes the weights a function of ``seed`` alone, whatever the stages:
a stage that owns some of a module's tensors runs the module's init with its other tensors
allocated for the call, so the random stream is consumed as in the whole model.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Callable, Iterable, Mapping
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn

from fxpipe.errors import WeightsError
from fxpipe.materialize.fillplan import FillPlan, plan_fill, tensor_table
from fxpipe.materialize.recipes import replay_placed
from fxpipe.materialize.weights import WeightSource, open_weights
from fxpipe.options import check_init

__all__ = ["fill", "materialize", "module_seed"]

log = logging.getLogger(__name__)

Init = Callable[[nn.Module], Any]


def module_seed(seed: int, fqn: str) -> int:
    """Return the seed of module ``fqn``'s initialisation: a hash of ``seed`` and the FQN."""
    digest = hashlib.sha256(f"{seed}/{fqn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def materialize(model: nn.Module, device: Any = "cpu", init: Init | None = None, weights: Any = None,
                seed: int = 0) -> nn.Module:
    """Allocate every ``meta`` tensor of ``model`` on ``device`` and fill it; return ``model``.

    ``weights`` (a state dict, a ``torch.save`` or safetensors file, a Hugging Face shard
    directory or an fxpipe checkpoint) fills tensors by FQN; the rest are initialised by
    ``init(module)``, or by each module's ``reset_parameters()``, seeded per module FQN from
    ``seed``, as ``fxpipe.compile(..., init=, seed=)`` does for each stage; a model built under
    :func:`fxpipe.deferred_init` gets the values its ``__init__`` gives (``init=`` still wins).
    Tensors that are already real keep their place (and get the source's values if it holds them).
    """
    check_init(init, seed)
    dev = torch.device(device)
    source = None if weights is None else open_weights(weights)
    try:
        table = tensor_table(model)
        fill(model, {key: dev for key in table}, source=source, init=init, seed=seed)
    finally:
        if source is not None:
            source.close()
    return model


def fill(model: nn.Module, placement: Mapping[int, torch.device], *, source: WeightSource | None,
         init: Init | None, seed: int, leave: bool = False) -> None:
    """Materialize and fill the tensors ``placement`` names (``id(tensor) -> device``).

    Every check covers the whole model, so each rank of a pipeline refuses the same bad input;
    only the placed tensors are allocated and read. ``leave``: what the source lacks is left
    as it is instead of initialised (a checkpoint's load).
    """
    table = tensor_table(model)
    plan = plan_fill(model, table, source, init, leave)
    if not plan.from_source and not plan.to_init:
        return
    done: list[tuple[torch.Tensor, torch.Tensor]] = []  # (tensor now real, its meta original)
    try:
        marks = _allocate(table, plan, placement, done)
        seed_of = functools.partial(module_seed, seed)
        if init is None:  # a recorded tensor's recipe wins over reset_parameters(); init= over the recipe
            _run_init(table, plan, placement, _reset, seed, marks, set())
            replayed = replay_placed(table, plan.recipes, plan.modules, placement, seed_of)
        else:
            replayed = replay_placed(table, plan.recipes, plan.modules, placement, seed_of)
            _run_init(table, plan, placement, init, seed, marks, replayed)
        wanted = {plan.from_source[key]: table[key].tensor for key in plan.from_source if key in placement}
        if wanted and source is not None:
            source.read(wanted)
        _verify(table, marks)
    except BaseException:
        for tensor, original in reversed(done):
            torch.utils.swap_tensors(tensor, original)
        raise
    log.info("materialized %d tensor(s): %d from %s, %d by init, %d by deferred_init's recipes",
             len(marks) + len(wanted) + len(replayed), len(wanted), source.description if source else "no weights",
             len(marks), len(replayed))


def _swap_in(tensor: torch.Tensor, device: torch.device, done: list) -> None:
    """Replace a meta tensor's contents by an empty real one of its shape on ``device``."""
    real = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device)
    if isinstance(tensor, nn.Parameter):
        real = nn.Parameter(real, requires_grad=tensor.requires_grad)
    torch.utils.swap_tensors(tensor, real)
    done.append((tensor, real))


def _allocate(table: dict, plan: FillPlan, placement: Mapping[int, torch.device],
              done: list) -> dict[int, int]:
    """Allocate the placed meta tensors; mark the ones init must fill; return id -> version."""
    marks: dict[int, int] = {}
    for key, device in placement.items():
        info = table.get(key)
        if info is None:  # not the model's (a constant of the traced graph): nothing to fill
            continue
        if info.tensor.is_meta and (key in plan.to_init or key in plan.from_source):
            _swap_in(info.tensor, device, done)
        if key in plan.to_init and key not in plan.recipes:
            marks[key] = _mark(info.tensor)
    return marks


def _mark(tensor: torch.Tensor) -> int:
    """Fill ``tensor`` with a value no init leaves everywhere; return its version after that.

    A bool tensor has no such value: it is written when its version moves (an in-place write).
    """
    with torch.no_grad():
        if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
            tensor.fill_(float("nan"))
        elif tensor.dtype != torch.bool:
            tensor.fill_(torch.iinfo(tensor.dtype).max)
    return tensor._version


def _run_init(table: dict, plan: FillPlan, placement: Mapping[int, torch.device], init: Init, seed: int,
              marks: dict[int, int], replayed: set[int]) -> None:
    """Initialise each module holding a placed tensor to init (or replayed), seeded by its FQN, in model order.

    A tensor tied across modules (an embedding and an output head) keeps the values its first
    holder's init gives it, as in eager where the later module's own tensor is replaced by the
    tie: that module runs after the others holding it (its ``padding_idx`` row stays zero).
    """
    modules = [(fqn, m, keys) for fqn, m, keys in plan.modules if any(k in marks or k in replayed for k in keys)]
    first = {id(table[k].slots[0].module) for _, _, keys in modules for k in keys
             if len({id(slot.module) for slot in table[k].slots}) > 1}
    modules.sort(key=lambda item: id(item[1]) in first)  # stable: model order otherwise
    if not modules:
        return
    cuda = sorted({d.index or 0 for d in placement.values() if d.type == "cuda"})
    with torch.random.fork_rng(devices=cuda):
        for fqn, module, keys in modules:
            device = next(placement[k] for k in keys if k in marks or k in replayed)
            with ExitStack() as temporary:
                for k in keys:  # the module's other tensors, for the call only: same random stream
                    if table[k].tensor.is_meta:
                        scratch: list = []
                        _swap_in(table[k].tensor, device, scratch)
                        temporary.callback(torch.utils.swap_tensors, *scratch[0])
                torch.manual_seed(module_seed(seed, fqn))
                init(module)
                _keep_identity(table, keys, marks)


def _reset(module: nn.Module) -> None:
    """The default init: the module's own ``reset_parameters()``."""
    module.reset_parameters()  # type: ignore[operator]


def _keep_identity(table: dict, keys: Iterable[int], marks: dict[int, int]) -> None:
    """Copy a tensor that init assigned anew into the original, which stays registered."""
    for key in keys:
        info = table[key]
        for slot in info.slots:
            now = slot.get()
            if now is info.tensor or now is None:
                continue
            if tuple(now.shape) != tuple(info.tensor.shape):
                raise WeightsError(f"init replaced '{slot.fqn}' by a tensor of shape {tuple(now.shape)}; "
                                   f"the model's is {tuple(info.tensor.shape)}")
            with torch.no_grad():
                if not info.tensor.is_meta:
                    info.tensor.copy_(now)
            slot.set(info.tensor)
            if key in marks:
                marks[key] = -1  # written


def _verify(table: dict, marks: dict[int, int]) -> None:
    """Refuse tensors init was to fill but left as allocated."""
    unset = [key for key, version in marks.items() if version != -1 and _unwritten(table[key].tensor, version)]
    if not unset:
        return
    names = [table[k].names[0] for k in unset]
    hidden = [n for k, n in zip(unset, names) if not table[k].persistent]
    if hidden:
        raise WeightsError(
            f"buffer(s) {hidden} are not persistent, so no checkpoint holds them, and init left them "
            "unset; pass init= a function init(module) that computes them (it runs on each module "
            "a stage owns, after allocation), or make their module's reset_parameters() do it")
    raise WeightsError(f"init left {names} unset; pass init= a function init(module) that fills every "
                       "tensor of the modules it is given, or weights= holding them")


def _unwritten(tensor: torch.Tensor, version: int) -> bool:
    """Tell whether ``tensor`` still holds the mark :func:`_mark` wrote."""
    if tensor.dtype == torch.bool:
        return tensor._version == version
    if tensor._version != version:
        return False
    with torch.no_grad():
        if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
            return bool(torch.isnan(tensor).all())
        return bool((tensor == torch.iinfo(tensor.dtype).max).all())
