"""Where a plan will run: the schedule, the devices it is planned for, and across ranks this process's place.

    options ─▶ schedule (resolved, checked for n stages) ─▶ one process: a device per stage
                                                        └▶ across ranks: join the process groups,
                                                           a device per rank, the pipeline's link

Known before tracing, since the plan's devices and the cost model depend on it. Across ranks
the process group is joined here (:mod:`fxpipe.runtime.transport.procgroup`), and every rank
plans with the same devices so that every rank makes the same plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.fx
from torch import nn

from fxpipe.frontend.tracing import refuse_parallel_wrapper
from fxpipe.materialize.fillplan import tensor_table
from fxpipe.materialize.metatensors import refuse_meta_constants
from fxpipe.materialize.weights import check_weights
from fxpipe.options import CompileOptions, valid_timeout
from fxpipe.runtime.placement import resolve_devices
from fxpipe.runtime.schedules.builtin import Schedule, resolve
from fxpipe.runtime.transport.comm import Comm
from fxpipe.runtime.transport.mesh import launched_world
from fxpipe.runtime.transport.procgroup import (
    Layout,
    agree_on_stages,
    check_launched_world,
    join_default_group,
    setup_distributed,
)
from fxpipe.runtime.transport.sameoptions import agree_on_options
from fxpipe.runtime.transport.sameweights import warn_other_weights

__all__ = ["Target", "where"]


@dataclass
class Target:
    """Where a plan runs: its schedule, the devices planned for, this process's device and place."""

    schedule: Schedule
    devices: list[torch.device]  # one per stage, as the plan names them
    device: torch.device  # this process's (one process: the first stage's); kernels are profiled there
    weights: Any = None  # the checked weights= source
    layout: Layout | None = None  # across ranks: this process's place
    link: Comm | None = None  # across ranks: the messages inside the pipeline

    def check_graph(self, model: nn.Module, gm: torch.fx.GraphModule, n_stages: int) -> None:
        """Refuse constants traced from meta tensors; across ranks, adopt rank 0's cut (costs may differ)."""
        refuse_meta_constants(model, gm)
        if self.layout is not None:
            agree_on_stages(gm, n_stages)


def _checked(model: nn.Module, options: CompileOptions) -> tuple[Schedule, Any]:
    """Refuse options no layer could use; return the resolved schedule and the checked weights."""
    options.check()
    refuse_parallel_wrapper(model)  # before the ranks compare their weights (a DTensor has no plain values)
    if options.balance_by == "time" and any(info.tensor.is_meta for info in tensor_table(model).values()):
        raise ValueError("balance_by='time' measures the model's kernels, which a model on meta cannot "
                         "run; use balance_by='flops'")
    if options.distributed and options.devices is not None:  # each rank runs on its own device
        raise ValueError(
            f"devices={list(options.devices)!r} places the stages of one process; with runtime='distributed' each "
            "rank runs its stages on its own device (the GPU of its LOCAL_RANK with NCCL, the CPU with gloo): "
            "leave devices= out (set the GPU a rank uses with CUDA_VISIBLE_DEVICES or torch.cuda.set_device)")
    n = options.n_stages
    if options.distributed:  # too few or many processes first: the schedule's needs depend on the world
        check_launched_world(n, options.stages_per_rank, options.data_parallel, options.mesh, options.tensor_parallel)
    schedule = resolve(options.schedule, n, options.chunks, options.stages_per_rank)
    options.check_layout()
    return schedule, check_weights(options.weights)


def _refuse_together(options: CompileOptions, refused: Exception) -> NoReturn:
    """Raise ``refused`` after joining the other ranks, which raise naming it (or the option that differs)."""
    try:  # a timeout= refused itself cannot time the join
        join_default_group(options.timeout if valid_timeout(options.timeout) else 300.0, launched_world())
    except Exception as exc:
        raise refused from exc
    agree_on_options(options, refused)
    raise refused  # not reached: agree_on_options raises it


def where(model: nn.Module, options: CompileOptions) -> Target:
    """Check the options, resolve the schedule and the devices, join the process groups across ranks; return the :class:`Target`.

    Across ranks an option refused on one rank only (a typo in a script that reads its options
    per rank, a ``weights=`` path on one node's disk) is refused after the ranks have joined:
    there the others raise :class:`OptionMismatchError` or :class:`PeerFailure` naming it at
    once, where they would wait out ``timeout=`` for a rank that never joins.
    """
    try:
        schedule, weights = _checked(model, options)
    except (TypeError, ValueError) as exc:
        if options.runtime != "distributed":
            raise
        _refuse_together(options, exc)
    n = options.n_stages
    if options.distributed:
        join_default_group(options.timeout, n // options.stages_per_rank * options.data_parallel
                           * options.tensor_parallel)
        agree_on_options(options)
        if options.weights is None:  # weights= loads the same on every rank
            warn_other_weights(model)
        layout = setup_distributed(n, options.timeout, options.stages_per_rank, options.data_parallel, options.mesh,
                                   options.tensor_parallel)
        link = Comm(layout.rank, options.timeout, layout.pp_group, layout.device, layout.global_ranks)
        devices = [torch.device(layout.device.type, r) for r in schedule.ranks]
        return Target(schedule, devices, layout.device, weights, layout, link)
    given = options.devices
    if given is None and schedule.world < n:  # a device per rank, its stages on it
        per_rank = resolve_devices(None, schedule.world)
        given = [per_rank[r] for r in schedule.ranks]
    devices = resolve_devices(given, n)
    return Target(schedule, devices, devices[0], weights)
