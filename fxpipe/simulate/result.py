"""A predicted training step: its time, bubble, timeline, and each stage's busy time and memory.

What :func:`fxpipe.simulate` returns (:class:`Simulation`), with its table and Chrome trace.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tabulate import tabulate

from fxpipe.options import checkpoint_stop
from fxpipe.plan.pipeline import human
from fxpipe.runtime.observe.timeline import Timeline
from fxpipe.simulate.devices import DeviceModel
from fxpipe.simulate.eventsim import Span
from fxpipe.simulate.memsim import Memory
from fxpipe.simulate.stagecost import StageCost
from fxpipe.simulate.tpcost import TPCost, tp_table

__all__ = ["Simulation", "StageResult"]

_KIND = {"F": "forward", "B": "backward", "I": "backward", "W": "weight"}


@dataclass
class StageResult:
    """One stage's predicted busy time, idle time (of its rank) and peak memory."""

    index: int
    rank: int
    busy: float
    idle: float
    memory: Memory


@dataclass
class Simulation:
    """A predicted training step: its time, each stage's busy and idle time and memory, the timeline."""

    step_time: float  # seconds
    bubble: float  # share of the ranks' time spent waiting
    stages: list[StageResult]
    devices: dict[int, Memory]  # per device (rank): memory of the stages it holds, live together
    spans: list[Span]
    schedule: str
    chunks: int
    checkpoint: str  # the policy, or the stages' policies joined by commas
    runtime: str
    device: DeviceModel
    costs: list[StageCost]
    batch: int
    policies: list[str] = dataclasses.field(default_factory=list)  # per stage
    tensor_parallel: int = 1  # ranks per stage
    tp: list[TPCost] | None = None  # per stage: its tensor-parallel collectives per micro-batch
    data_parallel: int = 1  # replicas of the pipeline, each on its own ``batch`` rows
    shard: bool = False  # FSDP2 over the replicas (else DDP)

    @property
    def throughput(self) -> float:
        """Return samples per second of the whole layout (every replica's rows)."""
        return self.batch * self.data_parallel / self.step_time if self.step_time else 0.0

    @property
    def gpus(self) -> int:
        """Return the devices the layout runs on: replicas x ranks per pipeline x tp."""
        return self.data_parallel * (1 + max((s.rank for s in self.stages), default=0)) * self.tensor_parallel

    def timeline(self) -> Timeline:
        """Return the predicted step as a :class:`~fxpipe.Timeline` (``.save(path)``: a Chrome trace)."""
        tl = Timeline()
        policies = self.policies or [self.checkpoint] * len(self.costs)
        for s in self.spans:
            a, c = s.action, self.costs[s.action.stage]
            start, end = s.start, s.end
            base = {"ph": "X", "pid": 0, "tid": a.stage,
                    "args": {"stage": a.stage, "micro_batch": a.mb, "device": f"{self.device.name} {s.rank}"}}
            redo = c.forward if a.mb < checkpoint_stop(policies[a.stage], self.chunks) else c.recompute
            if a.kind in ("B", "I") and redo:
                mid = min(start + redo, end)
                tl.events.append(base | {"name": f"recompute {a.mb}", "cat": "recompute", "ts": start * 1e6,
                                         "dur": (mid - start) * 1e6})
                start = mid
            kind = _KIND[a.kind]
            tl.events.append(base | {"name": f"{kind} {a.mb}", "cat": kind, "ts": start * 1e6,
                                     "dur": (end - start) * 1e6})
        tl.events.sort(key=lambda e: e["ts"])
        return tl

    def table(self) -> str:
        """Render the prediction: the step, then per stage busy, idle and memory."""
        policies = self.policies or [self.checkpoint] * len(self.stages)
        rows = [[s.index, s.rank, policies[s.index], f"{s.busy * 1e3:.2f}", f"{s.idle * 1e3:.2f}",
                 human(s.memory.params, "B"),
                 human(s.memory.grads, "B"), human(s.memory.optimizer, "B"), human(s.memory.activations, "B"),
                 human(s.memory.peak, "B")] for s in self.stages]
        layout = "".join([f", {self.data_parallel} replicas ({'FSDP2' if self.shard else 'DDP'})"
                          if self.data_parallel > 1 else "",
                          f", tensor parallel {self.tensor_parallel}" if self.tensor_parallel > 1 else ""])
        head = (f"predicted step ({self.schedule}, chunks={self.chunks}, checkpoint={self.checkpoint!r}, "
                f"{self.runtime}{layout}, {self.device.name}{' nominal' if self.device.nominal else ''}): "
                f"{self.step_time * 1e3:.2f} ms, {self.throughput:.1f} samples/s, bubble {self.bubble:.1%}")
        table = head + "\n" + tabulate(rows, headers=["stage", "rank", "checkpoint", "busy ms", "idle ms", "params",
                                                      "grads", "optimizer", "activations", "peak"], tablefmt="simple")
        return table + ("\n" + tp_table(self.tensor_parallel, self.tp) if self.tp else "")

    def __str__(self) -> str:
        return self.table()
