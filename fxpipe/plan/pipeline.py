"""The pipeline plan: stages, devices, boundary values, skip routes and costs."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from tabulate import tabulate

from fxpipe.passes.split import SkipRoute, StagePlan  # made by the split, filled in by the plan

__all__ = ["PipelinePlan", "SkipRoute", "StagePlan", "human", "tp_lines"]


@dataclass
class PipelinePlan:
    """Everything a runtime needs to run a partitioned model: serialisable and printable."""

    stages: list[StagePlan]
    skips: list[SkipRoute]
    chunks: int = 1
    checkpoint: str = "except_last"
    schedule: str = "gpipe"
    balance_by: str = "auto"
    graph_nodes: list[str] = field(default_factory=list)
    graph_ops: list[str] = field(default_factory=list)  # per graph node, empty in older plans
    graph_targets: list[str] = field(default_factory=list)  # per graph node, empty in older plans
    # per graph node, what it computes whatever its name (fxpipe.passes.structure); empty in older plans
    graph_keys: list[str] = field(default_factory=list)
    tensor_parallel: dict[str, Any] | None = None  # size, styles by module, collectives per micro-batch
    # how the pipe runs: runtime, data_parallel, data_parallel_shard, tensor_parallel, stages_per_rank
    # (what fxpipe.compile(plan=) reproduces; None in older plans)
    layout: dict[str, Any] | None = None
    # the batch the stages' costs were made for (fxpipe.simulate scales them to another; None in older plans)
    example_rows: int | None = None

    @property
    def n_stages(self) -> int:
        """Return the number of stages."""
        return len(self.stages)

    def policies(self) -> list[str]:
        """Return each stage's recomputation policy (a mode of ``fxpipe.options.CHECKPOINT_MODES``)."""
        return [s.checkpoint or self.checkpoint for s in self.stages]

    def stages_of(self, rank: int) -> list[int]:
        """Return the stages that run on ``rank``, in order."""
        return [s.index for s in self.stages if s.on_rank == rank]

    def producer(self) -> dict[str, int]:
        """Map each value that leaves a stage to the stage that makes it."""
        return {v: s.index for s in self.stages for v in s.outputs}

    def consumers(self) -> dict[str, list[int]]:
        """Map each value that enters a stage to the stages that read it, in order."""
        out: dict[str, list[int]] = {}
        for s in self.stages[1:]:
            for v in s.inputs:
                out.setdefault(v, []).append(s.index)
        return out

    def stashes(self, j: int) -> list[SkipRoute]:
        """Return the skip routes that stage ``j`` stashes."""
        return [r for r in self.skips if r.src == j]

    def pops(self, j: int) -> list[SkipRoute]:
        """Return the skip routes that stage ``j`` pops."""
        return [r for r in self.skips if r.dst == j]

    def metric(self) -> str:
        """Return the stage field the plan was balanced on: flops, time_ms, params or memory."""
        if self.balance_by == "time" and all(s.time_ms is not None for s in self.stages):
            return "time_ms"
        return self.balance_by if self.balance_by in ("params", "memory") else "flops"

    def bottleneck(self, by: str | None = None) -> float:
        """Return the largest stage value over the mean (1.0 is perfectly balanced).

        ``by`` names a stage field (``"flops"``, ``"time_ms"``, ``"params"``, ``"memory"``,
        ``"cost"``); the default is the one the plan was balanced on.
        """
        values = [float(getattr(s, by or self.metric()) or 0.0) for s in self.stages]
        mean = sum(values) / len(values)
        return max(values) / mean if mean else 1.0

    def efficiency(self, chunks: int | None = None, by: str | None = None) -> float:
        """Estimate pipeline efficiency m / (m + n - 1) * mean / max for ``chunks`` micro-batches."""
        m = chunks or self.chunks
        n = self.n_stages
        return m / (m + n - 1) / self.bottleneck(by)

    def table(self) -> str:
        """Render the stage table, the balance summary and the skip routes as text."""
        timed = any(s.time_ms is not None for s in self.stages)
        ranked = any(s.on_rank != s.index for s in self.stages)  # several stages per rank
        predicted = any(s.peak for s in self.stages)
        policies = self.policies()
        ops = dict(zip(self.graph_nodes, self.graph_ops))
        rows = []
        for s in self.stages:
            # first and last: what the stage computes, not the state or mode it reads (get_attr)
            computed = [v for v in s.nodes if ops.get(v) not in ("get_attr", "placeholder")
                        and not v.startswith(_BOOKKEEPING)] or s.nodes
            rows.append([s.index] + ([s.on_rank] if ranked else []) + [
                s.device, len(s.nodes), _short(computed[0] if computed else ""),
                _short(computed[-1] if computed else ""), human(s.flops), human(s.params, "B"),
                human(s.activation_bytes, "B"), human(s.saved_bytes, "B"),
                human(s.checkpoint_bytes, "B"), human(s.memory, "B"),
                "frozen" if s.frozen else policies[s.index] or "-",
            ] + ([human(s.peak, "B") if s.peak else "-"] if predicted else []) + (
                [f"{s.time_ms:.2f}" if s.time_ms is not None else "-"] if timed else []) + [
                len(self.stashes(s.index)), len(self.pops(s.index)),
            ])
        headers = ["stage"] + (["rank"] if ranked else []) + ["device", "nodes", "first", "last", "FLOPs f+b", "params", "act. out",
                   "kept", "kept ckpt", "memory", "checkpoint"] + (["peak"] if predicted else []) + (
                   ["ms"] if timed else []) + ["stash", "pop"]
        lines = [tabulate(rows, headers=headers, tablefmt="simple")]
        metric = self.metric()
        if metric == "flops" and not any(st.flops for st in self.stages):
            lines.append(f"bottleneck: unknown without example inputs (no FLOPs)   "
                         f"efficiency at chunks={self.chunks} if balanced: "
                         f"{self.chunks / (self.chunks + self.n_stages - 1):.1%}")
        else:
            lines.append(f"bottleneck (max/mean {_METRIC_NAMES[metric]}): {self.bottleneck():.3f}   "
                         f"estimated efficiency at chunks={self.chunks}: {self.efficiency():.1%}")
        if timed and metric != "time_ms" and all(s.time_ms is not None for s in self.stages):
            lines.append(f"measured bottleneck (max/mean ms): {self.bottleneck('time_ms'):.3f}   "
                         f"estimated efficiency at chunks={self.chunks}: "
                         f"{self.efficiency(by='time_ms'):.1%}")
        lines.append("per micro-batch: act. out = sent on, kept = saved for backward, kept ckpt = "
                     f"kept when checkpointed; memory = the cut's estimated peak (checkpoint={self.checkpoint!r})"
                     + ("; frozen = nothing needs a gradient: not recomputed, nothing kept"
                        if any(s.frozen for s in self.stages) else "")
                     + ("; peak = predicted along the schedule under the stage's checkpoint policy (parameters, "
                        "gradients, activations)" if predicted else ""))
        if self.tensor_parallel:
            lines += tp_lines(self.tensor_parallel)
        if self.skips:
            sizes = [r for r in self.skips if r.name.startswith("sym_size") and not r.bytes]  # export's sizes
            lines.append("skip routes:")
            lines += [f"  {r.name}: stage {r.src} -> stage {r.dst} ({human(r.bytes, 'B')})"
                      for r in self.skips if r not in sizes]
            if sizes:
                lines.append(f"  and {len(sizes)} symbolic size(s) of torch.export ({', '.join(r.name for r in sizes[:3])}"
                             f"{' ...' if len(sizes) > 3 else ''})")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict[str, Any]:
        """Return the plan as plain JSON-compatible data."""
        return {"format": "fxpipe.plan.pipeline/1", **asdict(self)}

    def to_json(self, **kwargs: Any) -> str:
        """Serialise the plan to a JSON string."""
        return json.dumps(self.to_dict(), **({"indent": 1} | kwargs))

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "the plan") -> PipelinePlan:
        """Rebuild a plan from :meth:`to_dict` output (``source`` names it in a refusal)."""
        data = dict(data)
        fmt = data.pop("format", None)
        if fmt != "fxpipe.plan.pipeline/1":
            raise ValueError(f"not an fxpipe plan (format={fmt!r}); save plans with plan.save(path)")
        data["stages"] = [StagePlan(**s) for s in data["stages"]]
        data["skips"] = [SkipRoute(**r) for r in data["skips"]]
        _check_counts(data, source)
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> PipelinePlan:
        """Rebuild a plan from :meth:`to_json` output."""
        return cls.from_dict(json.loads(text))

    def save(self, path: str) -> None:
        """Write the plan to ``path`` as JSON."""
        with open(path, "w") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str) -> PipelinePlan:
        """Read a plan written by :meth:`save`."""
        with open(path) as f:
            text = f.read()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path!r} is not a plan (not JSON: {exc}); pass a file plan.save(path) or "
                             "fxpipe plan --json FILE wrote") from None
        if not isinstance(data, dict):  # the file's content is wrong, not an argument's type
            raise ValueError(f"{path!r} is not a plan (JSON of a {type(data).__name__}); pass a file "  # noqa: TRY004
                             "plan.save(path) or fxpipe plan --json FILE wrote")
        return cls.from_dict(data, source=repr(path))


_COUNTS = ("chunks", "stages_per_rank", "data_parallel", "tensor_parallel")  # what a plan records as counts


def _check_counts(data: dict[str, Any], source: str) -> None:
    """Refuse a plan whose recorded counts (chunks, stages per rank, replicas) are not positive integers."""
    layout = data.get("layout")
    if layout is not None and not isinstance(layout, dict):
        raise ValueError(f"{source} records layout={layout!r}, where an object (runtime, stages_per_rank, "
                         "data_parallel, ...) or null belongs: correct the value in the file, or write the plan again "
                         "with plan.save(path) or fxpipe plan --json FILE")
    recorded = {"chunks": data.get("chunks", 1), **{f"layout.{k}": v for k, v in (layout or {}).items()
                                                    if k in _COUNTS}}
    for where, value in recorded.items():
        if type(value) is not int or value < 1:
            raise ValueError(f"{source} records {where}={value!r}, where a positive integer belongs: correct the "
                             "value in the file, or write the plan again with plan.save(path) or fxpipe plan --json "
                             "FILE")


_METRIC_NAMES = {"flops": "FLOPs f+b", "time_ms": "measured ms", "params": "parameter bytes",
                 "memory": "memory", "cost": "cost"}


# torch.export's bookkeeping nodes: the first and last columns name what a stage computes instead
_BOOKKEEPING = ("_guards_fn", "_assert", "sym_size", "sym_constrain")


def _short(name: str, width: int = 24) -> str:
    """Shorten a node name for the table."""
    return name if len(name) <= width else name[: width - 3] + "..."


def human(x: float, unit: str = "") -> str:
    """Format a count with a k/M/G/T suffix."""
    for suffix in ("", "k", "M", "G", "T"):
        if abs(x) < 1000:
            return f"{x:.0f}{suffix}{unit}" if suffix == "" else f"{x:.1f}{suffix}{unit}"
        x /= 1000
    return f"{x:.1f}P{unit}"


def tp_lines(tp: dict[str, Any]) -> list[str]:
    """Render a tensor-parallel record: the styles by module, what stays whole, collectives per micro-batch."""
    lines = [f"tensor parallel over {tp['size']} ranks per stage ({'auto' if tp['auto'] else 'tp_plan'}):"]
    calls: dict[str, list] = {}
    for c in tp["calls"]:
        calls.setdefault(c["module"], []).extend(c["collectives"])
    for fqn, style in tp["modules"].items():
        comm = ", ".join(f"{k} in {p} {human(b, 'B')}" for p, k, b in calls.get(fqn, []))
        lines.append(f"  {fqn}: {style}" + (f"   [{comm}]" if comm else ""))
    if tp["replicated"]:
        lines.append(f"  whole on every rank: {', '.join(tp['replicated'])}")
    every = [c for cs in calls.values() for c in cs]
    for kind in ("forward", "backward"):
        mine = [c for c in every if c[0] == kind]
        lines.append(f"  per micro-batch, {kind}: {len(mine)} collective(s), {human(sum(c[2] for c in mine), 'B')}")
    return lines
