"""What ``fxpipe plan --gpus`` found: each layout tried (:class:`Choice`), and the search's whole answer.

:class:`ClusterSearch` ranks the layouts that fit, keeps those rejected, and writes the first
choice as a plan, the ``fxpipe.compile(...)`` call that runs it and its ``torchrun`` line.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx

from fxpipe.options import AUTO
from fxpipe.plan.pipeline import PipelinePlan
from fxpipe.plan.saved import front_end_layout
from fxpipe.runtime.schedules.builtin import PLACEMENTS
from fxpipe.simulate.devices import DeviceModel
from fxpipe.simulate.layouts import Shape
from fxpipe.simulate.planner import _cut
from fxpipe.simulate.result import Simulation

__all__ = ["Choice", "ClusterSearch"]


@dataclass
class Choice:
    """One layout, its recomputation and simulated step (``sim`` is None when its state alone overflows)."""

    shape: Shape
    checkpoint: str  # a mode for every stage, or "auto": a policy per stage
    sim: Simulation | None
    fits: bool
    overflow: str = ""  # what does not fit, when it does not

    @property
    def policies(self) -> list[str]:
        """Return each stage's policy."""
        return list(self.sim.policies) if self.sim is not None else []

    @property
    def setting(self) -> str | list[str]:
        """Return what ``fxpipe.compile(checkpoint=...)`` takes."""
        return self.checkpoint if self.checkpoint != AUTO else self.policies

    @property
    def peak(self) -> float:
        """Return the fullest rank's predicted peak memory in bytes."""
        return max((m.peak for m in self.sim.devices.values()), default=0.0) if self.sim is not None else 0.0


@dataclass
class ClusterSearch:
    """The layouts that fit, fastest first, those rejected, and what the search skipped; makes plans of them.

    ``rejected``: over the memory budget. ``refused``: layouts ``fxpipe.compile`` refuses (a tensor
    shared by two stages on one rank under data parallel), whatever the memory.
    """

    ranked: list[Choice]
    rejected: list[Choice]
    gm: torch.fx.GraphModule
    device: DeviceModel
    gpus: int
    gpus_per_node: int
    batch: int  # global rows per step
    memory: float
    tokens: int = 1  # tokens per row (the sequence length), for tokens per second per GPU
    layouts: int = 0  # tried, before pruning
    simulated: int = 0
    bounded: int = 0  # skipped: their compute alone is slower than the kept ones
    seconds: float = 0.0
    cuts: dict[int, PipelinePlan] = field(default_factory=dict)
    refused: list[Choice] = field(default_factory=list)

    @property
    def best(self) -> Choice | None:
        """Return the fastest layout that fits, or None."""
        return self.ranked[0] if self.ranked else None

    def per_gpu(self, c: Choice) -> float:
        """Return tokens (rows without a sequence) per second per GPU."""
        return c.sim.throughput * self.tokens / self.gpus if c.sim is not None and c.sim.step_time else 0.0

    def plan(self, c: Choice) -> PipelinePlan:
        """Return ``c``'s plan: the cut, schedule, chunks, policies and layout ``fxpipe.compile(plan=)`` reproduces."""
        s = c.shape
        plan = _cut(self.gm, s.n_stages, self.device, 1, s.chunks, c.setting)
        plan.schedule, plan.chunks = s.schedule, s.chunks
        ranks = PLACEMENTS[s.schedule](s.n_stages, s.pp) if s.schedule in PLACEMENTS else list(range(s.n_stages))
        for st, policy, r in zip(plan.stages, c.policies, ranks):
            st.checkpoint, st.rank = policy, r
        plan.layout = {"runtime": "distributed", "data_parallel": s.dp, "data_parallel_shard": s.shard,
                       "tensor_parallel": s.tp, "stages_per_rank": s.v, **front_end_layout(self.gm)}
        return plan

    def compile_call(self, c: Choice, path: str = "plan.json") -> str:
        """Return the ``fxpipe.compile(...)`` call that runs ``c`` from its saved plan."""
        s = c.shape
        extra = "".join([f", stages_per_rank={s.v}" if s.v > 1 else "",
                         f", data_parallel={s.dp}" if s.dp > 1 else "",
                         ", data_parallel_shard=True" if s.shard else "",
                         f", tensor_parallel={s.tp}" if s.tp > 1 else ""])
        return (f"pipe = fxpipe.compile(model, {s.n_stages}, example_inputs=(x,), runtime=\"distributed\", "
                f"plan={path!r}, chunks={s.chunks}, schedule={s.schedule!r}, checkpoint={c.setting!r}{extra})")

    def launch_line(self, script: str = "train.py") -> str:
        """Return the ``torchrun`` line that starts the layout on this cluster (run on every node)."""
        per_node = min(self.gpus_per_node, self.gpus)
        nodes = -(-self.gpus // per_node)
        rdzv = " --rdzv-backend c10d --rdzv-endpoint $HEAD_NODE:29500" if nodes > 1 else ""
        return f"torchrun --nnodes {nodes} --nproc-per-node {per_node}{rdzv} {script}"
