"""Meta tensors of a model that no fill covers: constants torch.fx traced from them, and releasing to meta.

A traced graph may hold a tensor that torch.fx computed from meta buffers while tracing (no FQN
names it, so nothing can fill it): refused. After a distributed build a rank swaps every tensor it
does not keep for a meta one of the same shape, so it holds only its own stages.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence

import torch
import torch.fx
from torch import nn

from fxpipe.errors import CompileError, WeightsError
from fxpipe.materialize.fillplan import tensor_table

__all__ = ["refuse_meta_constants", "release", "released"]

# every module of the models a distributed compile swapped other ranks' tensors of (weakly: a module is freed as
# usual; no tensor gets a weak reference, which would forbid release's swap_tensors)
_RELEASED: weakref.WeakSet = weakref.WeakSet()

_GUARDED: weakref.WeakSet = weakref.WeakSet()  # the released models whose own call is refused (_refuse_call)

log = logging.getLogger(__name__)


def _refuse_call(model: nn.Module, args: object) -> None:
    """Refuse calling a model a distributed compile released: the other ranks' tensors are meta on this one."""
    raise CompileError(
        f"{type(model).__name__} was compiled with runtime='distributed', which left only this rank's stages' "
        "tensors real (the other stages' are on meta, holding no data), so the model itself cannot run here: call "
        "the pipe (pipe(x), pipe.step), or save with fxpipe.save on every rank and read the whole model back with "
        "fxpipe.load_state_dict(path) into a fresh one to run it unpipelined")


def refuse_meta_constants(model: nn.Module, gm: torch.fx.GraphModule) -> None:
    """Refuse tensors the trace computed from meta tensors: they hold no values and no FQN names them.

    torch.fx runs code on buffers while tracing (``torch.cos(self.table)``) and keeps the
    result as a constant of the graph; from a model on meta that constant is empty.
    """
    known = set(tensor_table(model))
    bad: list[str] = []
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        value = gm
        for part in node.target.split("."):
            value = getattr(value, part)
        if isinstance(value, torch.Tensor) and value.is_meta and id(value) not in known:
            stack = list((node.meta.get("nn_module_stack") or {}).values())
            where = f" in module '{stack[-1][0]}' ({getattr(stack[-1][1], '__name__', stack[-1][1])})" if stack else ""
            bad.append(f"'{node.target}'{where}")
    if bad:
        raise WeightsError(
            f"the traced graph holds {', '.join(bad)}: a tensor torch.fx computed while tracing from "
            "tensors on meta (it runs code on buffers eagerly and keeps the result), so it holds no "
            "values and no FQN names it; list that module in leaf_modules= so it runs at run time, "
            "or build the model on a real device")


def released(model: nn.Module) -> bool:
    """Tell whether a distributed compile on this process made the other ranks' tensors of ``model`` meta.

    Of ``model`` itself, of a model holding it, or of one of its submodules (the encoder of a
    compiled model; a GAN of a generator and a discriminator compiled apart): known alike on every
    rank, whichever holds which tensors.
    """
    return any(m in _RELEASED for m in model.modules())


def release(model: nn.Module, keep: set[int], also: Sequence[nn.Module] = ()) -> int:
    """Swap every real tensor of ``model`` outside ``keep`` for a meta one; return the bytes freed.

    A tensor that cannot be swapped in place (a weak reference to it, as torch.export's fake
    tensor memo keeps, forbids ``swap_tensors``) is replaced by a meta one in every module of
    ``model`` and ``also`` (the traced graph, the stages) that holds it: a rank must hold no
    real copy of another rank's tensor, or a save would write that stale copy beside the owner's.
    """
    _RELEASED.update(model.modules())
    if model not in _GUARDED:
        _GUARDED.add(model)
        model.register_forward_pre_hook(_refuse_call)
    freed = 0
    replaced: dict[int, torch.Tensor] = {}
    for key, info in tensor_table(model).items():
        t = info.tensor
        if key in keep or t.is_meta:
            continue
        empty = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        if isinstance(t, nn.Parameter):
            empty = nn.Parameter(empty, requires_grad=t.requires_grad)
        try:
            torch.utils.swap_tensors(t, empty)
        except RuntimeError as exc:  # a weak reference forbids the swap: register the meta one instead
            log.debug("replacing %s by a meta tensor wherever it is held: %s", info.names[0], exc)
            replaced[key] = empty
        freed += t.numel() * t.element_size()
    if replaced:
        _register(model, also, replaced)
    return freed


def _register(model: nn.Module, also: Sequence[nn.Module], replaced: dict[int, torch.Tensor]) -> None:
    """Put each new tensor (``id(old) -> new``) in every place of these modules that held the old one."""
    for root in (model, *also):
        for module in root.modules():
            for registry in (module._parameters, module._buffers):
                for name, t in list(registry.items()):
                    if t is not None and id(t) in replaced:
                        registry[name] = replaced[id(t)]  # type: ignore[assignment] # a Parameter for a Parameter
