"""Export a model built on ``meta``: its tensors presented as fake tensors of the target device.

torch.export runs the model's Python on fake tensors, but it fakes each tensor on the device
the tensor is on. A model built on ``meta`` would then be traced on meta, against example
inputs on CPU (a device mismatch), and code that branches on the device
(``torch.autocast(device_type=x.device.type)`` in Hugging Face's rotary embeddings) would see
``"meta"``, which autocast does not support. So for the export only, each meta parameter and
buffer is replaced in its module by a fake tensor of the same shape, stride and dtype on the
target device (the example inputs' device, else the stages'), then put back::

    module._parameters["weight"]:  meta Parameter ──swap──▶ fake Parameter on cpu ──export──▶ restore

A fake tensor holds no storage, so a model of any size stays free to trace. torch.export fakes
those fakes again in its own mode, keeping their device. The exported program refers to the
fakes by the model's FQNs, and :func:`fxpipe.frontend.export._share_state` puts the model's own (meta)
objects in their place, as it does for a real model; :func:`refuse_stand_ins` checks none is left.
The swap replaces entries of ``_parameters`` and ``_buffers``, not the tensors' contents
(:func:`torch.utils.swap_tensors`): torch.export never sees the model's own objects, so it
keeps no weak reference to them, and materializing them later (a swap) still works.
Meta example inputs are given to torch.export as fakes on the target device the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_map

from fxpipe.errors import TraceError

__all__ = ["fake_inputs", "fake_state", "meta_attributes", "meta_refusal", "refuse_stand_ins", "target_device"]

log = logging.getLogger(__name__)


def target_device(args: tuple, kwargs: dict, device: Any = None) -> torch.device:
    """Return where a meta model is presented: the example inputs' device, else ``device``, else CPU."""
    for t in tree_flatten((args, kwargs))[0]:
        if isinstance(t, torch.Tensor) and not t.is_meta:
            return t.device
    if device is not None and torch.device(device).type == "cpu":
        return torch.device("cpu")  # one CPU, however a rank's device names it ("cpu:0" meets "cpu" in the graph)
    if device is not None and torch.device(device).type != "meta":
        return torch.device(device)
    return torch.device("cpu")


def _fake(mode: FakeTensorMode, t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Return a fake tensor like ``t`` (shape, stride, dtype, gradient flag, Parameter) on ``device``."""
    with mode:
        fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
    if isinstance(t, nn.Parameter):
        return nn.Parameter(fake, requires_grad=t.requires_grad)
    return fake.requires_grad_(t.requires_grad)


def fake_inputs(args: tuple, kwargs: dict, device: torch.device) -> tuple[tuple, dict]:
    """Return ``args`` and ``kwargs`` with each meta tensor replaced by a fake one on ``device``."""
    if not any(isinstance(t, torch.Tensor) and t.is_meta for t in tree_flatten((args, kwargs))[0]):
        return args, kwargs
    mode = FakeTensorMode()

    def convert(t: Any) -> Any:
        return _fake(mode, t, device) if isinstance(t, torch.Tensor) and t.is_meta else t

    return tree_map(convert, (args, kwargs))


@contextmanager
def fake_state(model: nn.Module, device: torch.device) -> Iterator[int]:
    """Swap every meta parameter and buffer of ``model`` for a fake one on ``device`` inside the block.

    Yields how many tensors were swapped (a tied tensor counts once and stays tied); on leaving,
    every module holds its own tensor objects again, whatever happened inside.
    """
    mode = FakeTensorMode()
    fakes: dict[int, torch.Tensor] = {}
    swapped: list[tuple[dict, str, torch.Tensor]] = []
    try:
        for module in model.modules():
            registries: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
            for registry in registries:
                for name, t in list(registry.items()):
                    if t is None or not t.is_meta:
                        continue
                    if id(t) not in fakes:
                        fakes[id(t)] = _fake(mode, t, device)
                    swapped.append((registry, name, t))
                    registry[name] = fakes[id(t)]
        if fakes:
            log.debug("exporting %s with %d meta tensor(s) as fake tensors on %s",
                      type(model).__name__, len(fakes), device)
        yield len(fakes)
    finally:
        for registry, name, t in reversed(swapped):
            registry[name] = t


def meta_attributes(model: nn.Module) -> list[str]:
    """Name the meta tensors ``model`` keeps as plain attributes (neither parameter nor buffer)."""
    names = []
    for prefix, module in model.named_modules():
        for name, value in vars(module).items():
            if isinstance(value, torch.Tensor) and value.is_meta:
                names.append(f"{prefix}.{name}" if prefix else name)
    return names


def meta_refusal(model: nn.Module, exc: BaseException, device: torch.device, faked: int) -> TraceError | None:
    """Explain an export that failed on a meta tensor fxpipe could not present on ``device`` (else None).

    ``faked`` counts the model's tensors presented as fakes; with none and no meta attribute
    the model is not on meta, and the failure is left to the other explanations.
    """
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    plain = meta_attributes(model)
    if "meta" not in first or not (faked or plain):
        return None
    name = type(model).__name__
    if plain:
        cause = (f"{name} keeps tensor(s) {plain[:8]} on meta as plain attributes (neither parameter nor "
                 f"buffer), which fxpipe can neither present on {device} while exporting nor fill afterwards. "
                 "Register each as a buffer (self.register_buffer(name, tensor, persistent=False), computed "
                 "by init=), or build the model on a real device")
    else:
        cause = (f"a tensor on meta that is no parameter or buffer of {name} (made in forward with "
                 "device='meta', or held outside its modules) meets the example inputs; make it on the "
                 "inputs' or the parameters' device, or build the model on a real device")
    return TraceError(f"torch.export could not trace {name}, built on meta, with its tensors as fake "
                      f"tensors on {device}: {first}\n{cause}. The full torch.export error is chained below.")


def refuse_stand_ins(gm: torch.fx.GraphModule, model: nn.Module) -> None:
    """Refuse a graph holding a fake or meta tensor that is not one of the model's own tensors."""
    own = {id(t) for t in (*model.parameters(), *model.buffers())}
    held = [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]
    held += [(n.target, _attr(gm, n.target)) for n in gm.graph.nodes if n.op == "get_attr"]
    bad = sorted({name for name, t in held if isinstance(t, torch.Tensor) and id(t) not in own
                  and (isinstance(t, FakeTensor) or t.is_meta)})
    if bad:
        raise TraceError(f"the graph torch.export made of {type(model).__name__} holds tensor(s) {bad[:8]} "
                         "without values: stand-ins of meta tensors that are no parameter or buffer of the "
                         "model (plain attributes), so nothing can fill them. Register each as a buffer "
                         "(self.register_buffer(name, tensor, persistent=False), computed by init=), or "
                         "build the model on a real device")


def _attr(gm: torch.fx.GraphModule, target: str) -> Any:
    """Fetch the attribute ``target`` (dotted) of ``gm``, or None."""
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part, None)
    return value
