"""What ``fxpipe.simulate`` reads off what it is given: the graph and plan, the schedule, the device, runtime and layout.

A compiled Pipe, a :class:`~fxpipe.plan.PipelinePlan`, the path of a saved plan, or a
``(GraphModule, plan)`` pair; the layout (replicas, sharding, tp) comes from ``plan.layout``.
"""

from __future__ import annotations

from typing import Any

from fxpipe.plan.pipeline import PipelinePlan
from fxpipe.simulate.devices import DeviceModel
from fxpipe.simulate.network import Layout

__all__ = ["compiled_schedule", "default_device", "default_runtime", "graph_and_plan", "layout_of", "local_devices"]


def layout_of(plan: PipelinePlan, record: dict[str, Any] | None, dp: int | None, shard: bool | None) -> Layout:
    """Return the layout to simulate: the plan's replicas, sharding and tp, or the ones asked for."""
    own = plan.layout or {}
    for name, value in (("data_parallel", dp),):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name}={value!r}; use an integer of at least 1 (or leave it out for the pipe's)")
    return Layout(dp=dp or int(own.get("data_parallel", 1)), pp=1 + max(s.on_rank for s in plan.stages),
                  tp=int(record["size"]) if record is not None else 1,
                  shard=bool(own.get("data_parallel_shard", False)) if shard is None else bool(shard))


def graph_and_plan(obj: Any) -> tuple[Any, PipelinePlan]:
    """Return ``(GraphModule or None, plan)`` of a Pipe, a plan, the path of a saved plan, or a
    ``(GraphModule, plan)`` pair (an annotated graph whose stages the plan names)."""
    if isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[1], PipelinePlan):
        return obj
    if isinstance(obj, PipelinePlan):
        return None, obj
    if isinstance(obj, str):
        return None, PipelinePlan.load(obj)
    plan = getattr(obj, "plan", None)
    if isinstance(plan, PipelinePlan):
        return getattr(obj, "_gm", None), plan
    raise TypeError(f"fxpipe.simulate takes a compiled Pipe, a PipelinePlan or the path of a saved plan, "
                    f"got {type(obj).__name__}")


def compiled_schedule(obj: Any, plan: PipelinePlan) -> Any:
    """Return the schedule a pipe was compiled with: its name, or the user's own action lists."""
    compiled: Any = getattr(obj, "schedule", None) if hasattr(obj, "runtime") else None  # a Pipe's Schedule
    if getattr(compiled, "custom", None) is not None:
        return compiled.custom
    if plan.schedule == "custom":
        raise ValueError("the plan was compiled with your own schedule, whose actions a plan does not record; "
                         "pass them as schedule= (or simulate the compiled Pipe)")
    return plan.schedule


def default_device(plan: PipelinePlan) -> str:
    """Return ``"cpu"`` for a plan on CPUs; otherwise ask for a device model."""
    if all(s.device.startswith(("cpu", "rank")) and "cuda" not in s.device for s in plan.stages):
        return "cpu"
    raise ValueError("the plan runs on accelerators; name a device model: device='a100', 'h100', 'h200' "
                     "or a DeviceModel (from fxpipe.simulate.devices import DeviceModel)")


def default_runtime(plan: PipelinePlan, model: DeviceModel) -> str:
    """Return the plan's runtime: ranks for a distributed plan, and for a CPU plan simulated on accelerators."""
    names = [s.device for s in plan.stages]
    if names[0].startswith("rank") or (model.name != "cpu" and all(d.startswith("cpu") for d in names)):
        return "distributed"
    return "local"


def local_devices(plan: PipelinePlan, model: DeviceModel, rank_of: list[int]) -> list[int]:
    """Return the device of each stage in one process: stages on the same device share it."""
    names = [s.device for s in plan.stages]
    index = {d: k for k, d in enumerate(dict.fromkeys(names))}
    return [index[d] for d in names]
