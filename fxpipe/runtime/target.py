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
from typing import Any

import torch
import torch.fx
from torch import nn

from fxpipe.errors import WeightsError
from fxpipe.materialize.fillplan import tensor_table
from fxpipe.materialize.metatensors import refuse_meta_constants
from fxpipe.materialize.weights import check_weights
from fxpipe.options import CompileOptions
from fxpipe.runtime.placement import resolve_devices
from fxpipe.runtime.schedules.builtin import Schedule, resolve
from fxpipe.runtime.transport.comm import Comm
from fxpipe.runtime.transport.procgroup import Layout, agree_on_stages, check_launched_world, setup_distributed
from fxpipe.runtime.transport.sameoptions import agree_on_options

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


def where(model: nn.Module, options: CompileOptions) -> Target:
    """Resolve the schedule and the devices, join the process groups across ranks; return the :class:`Target`."""
    if options.balance_by == "time" and any(info.tensor.is_meta for info in tensor_table(model).values()):
        raise ValueError("balance_by='time' measures the model's kernels, which a model on meta cannot "
                         "run; use balance_by='flops'")
    n = options.n_stages
    if options.distributed and options.devices is not None:  # each rank runs on its own device
        raise ValueError(
            f"devices={list(options.devices)!r} places the stages of one process; with runtime='distributed' each "
            "rank runs its stages on its own device (the GPU of its LOCAL_RANK with NCCL, the CPU with gloo): "
            "leave devices= out (set the GPU a rank uses with CUDA_VISIBLE_DEVICES or torch.cuda.set_device)")
    if options.distributed:  # too few or many processes first: the schedule's needs depend on the world
        check_launched_world(n, options.stages_per_rank, options.data_parallel, options.mesh, options.tensor_parallel)
    schedule = resolve(options.schedule, n, options.chunks, options.stages_per_rank)
    options.check_layout()
    refused: Exception | None = None
    try:
        weights = check_weights(options.weights)
    except WeightsError as exc:  # across ranks: join first, so that every rank refuses (a path on one node only)
        if not options.distributed:
            raise
        refused, weights = exc, None
    if options.distributed:
        layout = setup_distributed(n, options.timeout, options.stages_per_rank, options.data_parallel, options.mesh,
                                   options.tensor_parallel)
        agree_on_options(options, refused)
        link = Comm(layout.rank, options.timeout, layout.pp_group, layout.device, layout.global_ranks)
        devices = [torch.device(layout.device.type, r) for r in schedule.ranks]
        return Target(schedule, devices, layout.device, weights, layout, link)
    given = options.devices
    if given is None and schedule.world < n:  # a device per rank, its stages on it
        per_rank = resolve_devices(None, schedule.world)
        given = [per_rank[r] for r in schedule.ranks]
    devices = resolve_devices(given, n)
    return Target(schedule, devices, devices[0], weights)
