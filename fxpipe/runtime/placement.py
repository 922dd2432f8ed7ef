"""Choose devices, give each parameter and buffer one owning stage, and move them there.

A tensor is owned by the first stage that reads it and lives on that stage's device. A later
stage on another device that reads it too (tied embeddings) gets a differentiable copy made
at each call, so its gradient flows back into the one real ``Parameter`` and equals eager.
Tensors are moved in place (``param.data``; buffers re-registered on their own module), so
the model's own ``Parameter`` objects stay the ones that receive gradients.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fxpipe.errors import user_stacklevel
from fxpipe.plan.stages import named_tensors

__all__ = ["Ownership", "move_owned", "named_tensors", "ownership", "register_everywhere", "resolve_devices",
           "stage_callable", "warn_shared_storage"]

log = logging.getLogger(__name__)


def resolve_devices(devices: Sequence[Any] | None, n_stages: int) -> list[torch.device]:
    """Return one existing device per stage, defaulting to CUDA when present, else CPU."""
    if devices is None:
        if torch.cuda.is_available():
            count = torch.cuda.device_count()
            return [torch.device("cuda", j % count) for j in range(n_stages)]
        return [torch.device("cpu")] * n_stages
    if isinstance(devices, (str, torch.device)):
        raise TypeError(f"devices must be a list with one device per stage, got {devices!r}; "
                        f"for example devices=[{str(devices)!r}] * {n_stages}")
    devices = list(devices)
    if len(devices) != n_stages:
        raise ValueError(f"devices has {len(devices)} entries but n_stages={n_stages}; give one "
                         "device per stage (with several stages per rank, repeat a rank's device for each of its "
                         "stages, or leave devices= out: a rank's stages then share one)")
    out = []
    for d in devices:
        try:
            dev = torch.device(d)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"devices holds {d!r}, which is not a device: {exc}") from None
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"devices holds {d!r} but CUDA is not available; use 'cpu'")
            index = torch.cuda.current_device() if dev.index is None else dev.index
            if index >= torch.cuda.device_count():
                raise ValueError(f"devices holds {d!r} but only {torch.cuda.device_count()} CUDA "
                                 f"device(s) exist")
            dev = torch.device("cuda", index)
        elif dev.type == "meta":
            raise ValueError(f"devices holds {d!r}: meta tensors hold no data, so moving the model "
                             "there would destroy its weights; use 'cpu' or a CUDA device")
        elif dev.type != "cpu" and (not hasattr(torch, dev.type) or not getattr(torch, dev.type).is_available()):
            raise ValueError(f"devices holds {d!r} but that backend is not available")
        out.append(dev)
    return out


@dataclass
class Ownership:
    """Which stage owns each tensor, and which stages read tensors owned elsewhere."""

    owner: dict[int, int] = field(default_factory=dict)  # id(tensor) -> stage
    tensors: dict[int, torch.Tensor] = field(default_factory=dict)  # id(tensor) -> tensor
    foreign: list[list[str]] = field(default_factory=list)  # per stage: names read from another device


def ownership(stages: Sequence[torch.fx.GraphModule], devices: Sequence[torch.device]) -> Ownership:
    """Assign each parameter and buffer to the first stage that reads it."""
    own = Ownership()
    for j, gm in enumerate(stages):
        for _, t in named_tensors(gm):
            if id(t) not in own.owner:
                own.owner[id(t)] = j
                own.tensors[id(t)] = t
    for j, gm in enumerate(stages):
        names = [name for name, t in named_tensors(gm) if devices[own.owner[id(t)]] != devices[j]]
        own.foreign.append(names)
        if names:
            log.info("stage %d reads %d tensor(s) owned by a stage on another device: %s",
                     j, len(names), ", ".join(names[:5]))
    return own


def move_owned(roots: Sequence[nn.Module], own: Ownership, devices: Sequence[torch.device]) -> None:
    """Move every owned tensor to its owner's device in every module of ``roots``.

    Parameters move in place (``param.data``), so their identity is kept; a buffer is moved
    once and the copy is registered wherever the old one was.
    """
    targets = {i: devices[j] for i, j in own.owner.items() if own.tensors[i].device != devices[j]}
    if not targets:
        return
    moved: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for root in roots:
            for module in root.modules():
                for p in module._parameters.values():
                    if p is not None and id(p) in targets and id(p) not in moved:
                        p.data = p.data.to(targets[id(p)])
                        moved[id(p)] = p
                for name, b in list(module._buffers.items()):
                    if b is not None and id(b) in targets:
                        if id(b) not in moved:
                            moved[id(b)] = b.to(targets[id(b)])
                        module._buffers[name] = moved[id(b)]


def stage_callable(gm: torch.fx.GraphModule, foreign: list[str], device: torch.device) -> Callable:
    """Return a function running ``gm``, with foreign tensors copied to ``device`` per call."""
    if not foreign:
        return gm
    state = dict(named_tensors(gm))
    # one name per tensor: functional_call applies it to every name tied to that tensor
    first = {id(state[name]): name for name in reversed(foreign)}
    foreign = [name for name in foreign if first[id(state[name])] == name]

    def run(*args: Any) -> Any:
        replicas = {name: state[name].to(device) for name in foreign}
        return torch.func.functional_call(gm, replicas, args)

    return run


def register_everywhere(roots: Sequence[nn.Module], swapped: dict[int, nn.Parameter]) -> None:
    """Put new (DTensor) parameters wherever the ones they replace were registered (``id(old) -> new``).

    ``fully_shard`` and ``parallelize_module`` register new parameters on the modules they wrap;
    the model and the other stage modules must hold the same objects, so the model's own
    parameters are the ones trained and saved.
    """
    for root in roots:
        for module in root.modules():
            for name, p in list(module._parameters.items()):
                if p is not None and id(p) in swapped and swapped[id(p)] is not p:
                    module._parameters[name] = swapped[id(p)]


def warn_shared_storage(stages: Sequence[nn.Module], rank_of: Sequence[int]) -> None:
    """Warn of two parameters sharing storage (``nn.Parameter(a.weight.data)``) in stages on different ranks.

    One tensor read by several ranks is tied: fxpipe keeps its copies equal. Two parameter objects
    sharing storage are not the same tensor; each rank holds its own copy, so an update of one no
    longer reaches the other, as it does in one process.
    """
    seen: dict[int, tuple[str, int, int]] = {}  # storage -> (name, stage, id) of the first parameter met
    for j, st in enumerate(stages):
        for name, p in st.named_parameters():
            if p.device.type == "meta":
                continue
            ptr = p.untyped_storage().data_ptr()
            first = seen.setdefault(ptr, (name, j, id(p)))
            if first[2] != id(p) and rank_of[first[1]] != rank_of[j]:
                warnings.warn(
                    f"parameters '{first[0]}' (stage {first[1]}, rank {rank_of[first[1]]}) and '{name}' "
                    f"(stage {j}, rank {rank_of[j]}) share storage but are different Parameters: each rank holds its own copy, so an "
                    f"update of one no longer reaches the other. Tie them as one Parameter ('{name}' = '{first[0]}'), "
                    "whose copies fxpipe keeps equal across ranks, or give each its own storage (.clone())",
                    stacklevel=user_stacklevel())
                seen[ptr] = (name, j, id(p))  # once per pair
