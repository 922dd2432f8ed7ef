"""Execute a schedule's action lists: forward and backward per stage with explicit boundaries.

This is the engine of 1F1B in one process and of every schedule across ranks. Each action
receives its inputs (or gradients) through a *transport*, runs a :class:`StageWorker`, and
sends its outputs (or input gradients) on: the next stage gets boundary values, a later
stage gets its skips directly, and every gradient goes straight back to the stage that
made the value. The order of actions is generated code (:func:`action_source`), readable as
``pipe.code``.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from fxpipe.tools import recorder
from fxpipe.runtime.codegen import checkpoint_stop, compile_source
from fxpipe.runtime.microbatch import to_device
from fxpipe.plan import PipelinePlan
from fxpipe.runtime.schedule import SCHEDULES, Action, clocks, in_flight
from fxpipe.runtime.worker import StageWorker

__all__ = ["Transport", "LocalTransport", "ActionRunner", "action_source", "compile_actions"]


class Transport(Protocol):
    """Moves values and gradients between stages for micro-batch ``i``."""

    def recv_forward(self, j: int, i: int) -> list[Any]:
        """Return stage ``j``'s input values for micro-batch ``i``."""

    def send_forward(self, j: int, i: int, outputs: Sequence[Any]) -> None:
        """Deliver stage ``j``'s outputs to every stage that reads them."""

    def recv_backward(self, j: int, i: int) -> list[Any]:
        """Return the summed gradient of each of stage ``j``'s outputs."""

    def send_backward(self, j: int, i: int, grads: Sequence[Any]) -> None:
        """Send the gradients of stage ``j``'s inputs back to the stages that made them."""


class LocalTransport:
    """Hand values between stages of one process through a mailbox, on the right device."""

    def __init__(self, plan: PipelinePlan, devices: Sequence[torch.device]) -> None:
        self.plan = plan
        self.devices = list(devices)
        self.producer = plan.producer()
        self.consumers = plan.consumers()
        self.box: dict[tuple, Any] = {}
        self.inputs: list[list[Any]] = []

    def recv_forward(self, j: int, i: int) -> list[Any]:
        """Take stage ``j``'s inputs from the mailbox (stage 0: the micro-batch)."""
        if j == 0:
            return self.inputs[i]
        return [self.box.pop(("F", v, i, j)) for v in self.plan.stages[j].inputs]

    def send_forward(self, j: int, i: int, outputs: Sequence[Any]) -> None:
        """Put each output in the mailbox of each stage that reads it."""
        if j == self.plan.n_stages - 1:
            return
        for v, value in zip(self.plan.stages[j].outputs, outputs):
            for c in self.consumers.get(v, ()):
                self.box[("F", v, i, c)] = to_device(value, self.devices[c])

    def recv_backward(self, j: int, i: int) -> list[Any]:
        """Sum the gradients each output received from its consumers."""
        grads = []
        for v in self.plan.stages[j].outputs:
            parts = self.box.pop(("B", v, i), [])
            grads.append(_sum_grads(parts) if parts else None)
        return grads

    def send_backward(self, j: int, i: int, grads: Sequence[Any]) -> None:
        """Post each input's gradient to the stage that made the input."""
        if j == 0:
            return
        for v, g in zip(self.plan.stages[j].inputs, grads):
            if g is not None:
                self.box.setdefault(("B", v, i), []).append(to_device(g, self.devices[self.producer[v]]))


def _sum_grads(parts: list[Any]) -> Any:
    """Sum the gradients of one value leaf by leaf (a tuple's are not concatenated); None adds nothing."""
    if len(parts) == 1:
        return parts[0]
    spec = tree_flatten(parts[0])[1]
    summed = []
    for column in zip(*(tree_flatten(p)[0] for p in parts)):
        tensors = [t for t in column if isinstance(t, torch.Tensor)]
        summed.append(sum(tensors[1:], tensors[0]) if tensors else None)
    return tree_unflatten(summed, spec)


class ActionRunner:
    """Run stages' forward and backward actions over a transport; what generated code calls."""

    def __init__(self, plan: PipelinePlan, workers: dict[int, StageWorker], transport: Any) -> None:
        self.plan = plan
        self.workers = workers
        self.transport = transport
        self.stop = 0
        self.grad = True
        self.losses: dict[int, Callable[[Any], torch.Tensor]] = {}
        self.total: torch.Tensor | None = None
        self.outputs: dict[int, Any] = {}

    def begin(self, m: int, losses: dict[int, Callable[[Any], torch.Tensor]], checkpointing: bool,
              grad: bool = True) -> None:
        """Prepare a step of ``m`` micro-batches: a loss per micro-batch, or outputs kept without grad."""
        self.stop = checkpoint_stop(self.plan.checkpoint, m) if checkpointing and grad else 0
        self.grad = grad
        self.losses = losses
        self.total = None
        self.outputs = {}

    def forward(self, j: int, i: int) -> None:
        """Run F(i) on stage ``j``: receive, compute, send."""
        inputs = self.transport.recv_forward(j, i)
        last = j == self.plan.n_stages - 1
        worker = self.workers[j]
        with recorder.span("forward", j, i, worker.device):  # timeline
            out = worker.forward(i, inputs, checkpoint=i < self.stop,
                                 loss=self.losses.get(i) if last else None, grad=self.grad)
        if last and i in self.losses:
            self.total = out if self.total is None else self.total + out
        elif last:
            self.outputs[i] = out
        else:
            self.transport.send_forward(j, i, out)

    def backward(self, j: int, i: int) -> None:
        """Run B(i) on stage ``j``: receive output gradients, backpropagate, send input gradients."""
        grads = None if j == self.plan.n_stages - 1 else self.transport.recv_backward(j, i)
        worker = self.workers[j]
        with recorder.span("backward", j, i, worker.device):  # timeline (recompute included)
            input_grads = worker.backward(i, grads)
        self.transport.send_backward(j, i, input_grads)

    def weight(self, j: int, i: int) -> None:
        """Run W(i) on stage ``j``: the weight gradients its backward deferred."""
        worker = self.workers[j]
        with recorder.span("weight", j, i, worker.device):  # timeline
            worker.weights(i)


def action_source(plan: PipelinePlan, m: int, stages: Sequence[int], name: str, schedule: str) -> str:
    """Return the source of a function running ``stages``' actions for ``m`` micro-batches.

    With several stages (one process) the actions interleave in clock order; with one stage
    (one rank) they run in that stage's order, and communication orders the ranks.
    """
    actions = SCHEDULES[schedule](plan.n_stages, m)
    at = clocks(actions)
    mine = sorted((a for j in stages for a in actions[j]), key=lambda a: (at[a], a.stage))
    held = max(in_flight(actions[j]) for j in stages)
    where = f"stage {stages[0]} of {plan.n_stages}" if len(stages) == 1 else f"{plan.n_stages} stages"
    lines = [f"def {name}(rt):",
             f'    """{schedule}: {where}, {m} micro-batches, at most {held} in flight per stage."""',
             "    F, B, W = rt.forward, rt.backward, rt.weight" if any(a.kind == "W" for a in mine)
             else "    F, B = rt.forward, rt.backward"]
    clock = None
    for a in mine:
        if at[a] != clock:
            clock = at[a]
            lines.append(f"    # clock {clock}")
        lines.append(f"    {a.kind}({a.stage}, {a.mb})" + _comment(plan, a))
    return "\n".join(lines) + "\n"


def _comment(plan: PipelinePlan, a: Action) -> str:
    """Describe what an action receives and sends, for the generated code."""
    stage = plan.stages[a.stage]
    producer, consumers = plan.producer(), plan.consumers()
    if a.kind == "W":
        return "  # weight gradients"
    if a.kind == "F":
        src = sorted({producer[v] for v in stage.inputs if v in producer}) if a.stage else []
        dst = sorted({c for v in stage.outputs for c in consumers.get(v, ())})
        return f"  # recv {src or 'inputs'} -> send {dst or 'loss'}"
    dst = sorted({producer[v] for v in stage.inputs if v in producer}) if a.stage else []
    src = sorted({c for v in stage.outputs for c in consumers.get(v, ())})
    return f"  # grads from {src or 'loss'} -> to {dst or 'none'}"


def compile_actions(plan: PipelinePlan, m: int, stages: Sequence[int], schedule: str) -> tuple[str, Callable]:
    """Generate and compile the program running ``stages``' actions of ``schedule``."""
    tag = "all" if len(stages) > 1 else f"stage{stages[0]}"
    name = f"{schedule.replace('1f1b', 'one_f_one_b')}_{tag}_{plan.n_stages}x{m}"
    source = action_source(plan, m, stages, name, schedule)
    return source, compile_source(source, name, f"<fxpipe {name}>")
