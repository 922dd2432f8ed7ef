"""Run a schedule's action lists: one handler per action, in a plain interpreter loop.

This is the engine of ``pipe.step`` for every schedule but GPipe in one process, and of
every schedule across ranks. A program is a schedule's compute actions with the sends and
receives the runtime adds (:func:`fxpipe.runtime.schedules.actions.lower`), grouped by clock::

    clock 0:  0F0 0SEND_F0
    clock 1:  1RECV_F0 1F0 1SEND_F0 | 0F1 0SEND_F1        (| : another stage, another device)
    clock 2:  1RECV_B0 ...

Each compute action runs a :class:`~fxpipe.runtime.stage.worker.StageWorker`; each message moves
values through a *transport*: a mailbox with copy streams in one process
(:mod:`fxpipe.runtime.transport.mailbox`), point-to-point messages across ranks
(:mod:`fxpipe.runtime.transport.messages`). The next stage gets boundary values, a later stage
gets its skips directly, and every gradient goes straight back to the stage that made the
value. With worker threads (one per CUDA device), the stages of a clock run together.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from fxpipe.options import checkpoint_stop, saving_pass
from fxpipe.plan.pipeline import PipelinePlan
from fxpipe.runtime.schedules.actions import COMPUTE, Action, clocks, format_schedule, in_flight, lower
from fxpipe.runtime.stage.rng import autocast_off
from fxpipe.runtime.stage.threads import DeviceThreads
from fxpipe.runtime.stage.worker import StageWorker

__all__ = ["ActionInterpreter", "Program", "Transport", "fused_pairs", "program_for"]


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


class Program:
    """A lowered action program: per clock, per stage, the actions to run in order."""

    def __init__(self, clocked: list[list[list[Action]]], header: str) -> None:
        self.clocked = clocked  # clock -> groups (one per stage acting in it) -> actions
        self.header = header
        self.fused = fused_pairs(clocked)  # per stage: micro-batches whose W directly follows their I

    def text(self) -> str:
        """Return the program as text: a header, then one line of actions per clock."""
        lines = [f"# {line}" for line in self.header.splitlines()]
        for k, groups in enumerate(self.clocked):
            lines.append(f"{' | '.join(' '.join(map(str, g)) for g in groups)}    # clock {k}")
        return "\n".join(lines) + "\n"


def program_for(plan: PipelinePlan, actions: Sequence[Sequence[Action]], stages: Sequence[int],
                name: str) -> Program:
    """Lower ``stages``' actions of a schedule into a program, in clock order.

    A stage that takes values from other stages receives them before its forward and sends
    its outputs after; gradients go the other way. Whether a hand-over is a message (another
    rank) or stays in memory (one process, or one rank) is the transport's business.
    """
    at = clocks(actions, plan.n_stages)
    mine = sorted((a for row in actions for a in row if a.stage in stages), key=lambda a: (at[a], a.stage))
    producer, consumers = plan.producer(), plan.consumers()
    recv_f, send_f, recv_b, send_b = {}, {}, {}, {}
    for j in stages:
        s = plan.stages[j]
        recv_f[j] = any(v in producer for v in s.inputs)
        send_f[j] = any(consumers.get(v) for v in s.outputs)
        send_b[j] = any(v in s.grad_inputs and v in producer for v in s.inputs)
        recv_b[j] = any(v in plan.stages[c].grad_inputs for v in s.outputs for c in consumers.get(v, ()))
    clocked: list[list[list[Action]]] = []
    for a in mine:
        while len(clocked) <= at[a]:
            clocked.append([])
        clocked[at[a]].append(lower([a], recv_f, send_f, recv_b, send_b))
    held = max((in_flight(row) for row in actions if row and row[0].stage in stages), default=0)
    where = f"stage {stages[0]} of {plan.n_stages}" if len(stages) == 1 else f"{plan.n_stages} stages"
    m = 1 + max((a.mb for row in actions for a in row), default=-1)
    header = (f"{name}: {where}, {m} micro-batches, at most {held} in flight per stage\n"
              "pipe.step runs these actions, clock by clock; the schedule itself (compute actions):\n"
              + format_schedule([[a for a in row if a.kind in COMPUTE] for row in actions]).rstrip())
    return Program([g for g in clocked if g], header)


class ActionInterpreter:
    """Run a program's actions: compute on workers, messages over a transport."""

    def __init__(self, plan: PipelinePlan, workers: dict[int, StageWorker], transport: Transport,
                 threads: DeviceThreads | None = None) -> None:
        self.plan = plan
        self.workers = workers
        self.transport = transport
        self.threads = threads
        self.stop: dict[int, int] = {}  # per stage: micro-batches below it are checkpointed
        self.passes = {j: saving_pass(p) for j, p in enumerate(plan.policies())}
        self.saving = False  # whether stages run their policy's pass (training with grad)
        self.grad = True
        self.losses: dict[int, Callable[[Any], torch.Tensor]] = {}
        self.total: torch.Tensor | None = None
        self.outputs: dict[int, Any] = {}
        self._held: dict[tuple[str, int, int], Any] = {}  # values between a message and its compute
        self._ahead: dict[Action, int] = {}  # compute action -> the micro-batch of its stage's next backward
        self._handlers: dict[str, Callable[[int, int], None]] = {
            "F": self.forward, "B": self.backward, "I": self.backward_input, "W": self.weight,
            "RECV_F": self.recv_forward, "SEND_F": self.send_forward,
            "RECV_B": self.recv_backward, "SEND_B": self.send_backward}

    def begin(self, m: int, losses: dict[int, Callable[[Any], torch.Tensor]], checkpointing: bool,
              grad: bool = True) -> None:
        """Prepare a step of ``m`` micro-batches: a loss per micro-batch, or outputs kept without grad."""
        on = checkpointing and grad
        self.stop = {j: checkpoint_stop(p, m) if on else 0 for j, p in enumerate(self.plan.policies())}
        self.saving = on
        self.grad = grad
        self.losses = losses
        self.total = None
        self.outputs = {}
        self._held = {}

    def run(self, program: Program) -> None:
        """Run every clock of ``program``; a clock's stages together when there are worker threads."""
        self._ahead = _lookahead(program) if any(w.fetches for w in self.workers.values()) else {}
        for j, worker in self.workers.items():
            worker.fused = program.fused.get(j, frozenset())
        for groups in program.clocked:
            if self.threads is not None and len(groups) > 1:
                self.threads.run([(self.workers[g[0].stage].device, self.run_actions, (g,)) for g in groups])
            else:
                for g in groups:
                    self.run_actions(g)
        self._held.clear()  # the first stage's input gradients: nobody receives them
        # but a model input requiring grad gets its own, and a target requiring grad (fxpipe.runtime.targetgrads):
        # in one backward, as they may share the user's graph
        pairs = [pair for worker in self.workers.values() for pair in worker.released()]
        targets = getattr(self.losses, "released", None)
        pairs += targets() if targets is not None and self.grad else []
        if pairs:
            with autocast_off():
                torch.autograd.backward([x for x, _ in pairs], [g for _, g in pairs])

    def run_actions(self, actions: Sequence[Action]) -> None:
        """Run actions one after another (an offloading stage first fetches its next backward's activations)."""
        for a in actions:
            if a in self._ahead:
                self.workers[a.stage].prefetch(self._ahead[a])
            self._handlers[a.kind](a.stage, a.mb)

    # -- compute ---------------------------------------------------------------------------
    def forward(self, j: int, i: int) -> None:
        """F: run micro-batch ``i``'s forward on stage ``j``."""
        inputs = self._held.pop(("in", j, i), None)
        if inputs is None:  # the first stage reads the micro-batch; a stage without inputs, nothing
            inputs = self.transport.recv_forward(j, i) if j == 0 else []
        last = j == self.plan.n_stages - 1
        out = self.workers[j].forward(i, inputs, checkpoint=i < self.stop.get(j, 0),
                                      loss=self.losses.get(i) if last else None, grad=self.grad,
                                      saving=self.passes[j] if self.saving else "forward")
        if last and i in self.losses:
            self.total = out if self.total is None else self.total + out
        elif last:
            self.outputs[i] = out
        else:
            self._held[("out", j, i)] = out

    def backward(self, j: int, i: int, kind: str = "B") -> None:
        """B: backpropagate micro-batch ``i`` through stage ``j``, weights included."""
        default = None if j == self.plan.n_stages - 1 else [None] * len(self.plan.stages[j].outputs)
        grads = self._held.pop(("grad_out", j, i), default)
        self._held[("grad_in", j, i)] = self.workers[j].backward(i, grads, kind)

    def backward_input(self, j: int, i: int) -> None:
        """I: backpropagate micro-batch ``i`` through stage ``j`` to its inputs only."""
        self.backward(j, i, "I")

    def weight(self, j: int, i: int) -> None:
        """W: compute the weight gradients stage ``j``'s ``I`` of micro-batch ``i`` deferred."""
        self.workers[j].weights(i)

    # -- messages ----------------------------------------------------------------------------
    def recv_forward(self, j: int, i: int) -> None:
        """RECV_F: take stage ``j``'s inputs of micro-batch ``i``."""
        self._held[("in", j, i)] = self.transport.recv_forward(j, i)

    def send_forward(self, j: int, i: int) -> None:
        """SEND_F: send stage ``j``'s outputs of micro-batch ``i`` to the stages that read them."""
        self.transport.send_forward(j, i, self._held.pop(("out", j, i)))

    def recv_backward(self, j: int, i: int) -> None:
        """RECV_B: take the gradients of stage ``j``'s outputs of micro-batch ``i``."""
        self._held[("grad_out", j, i)] = self.transport.recv_backward(j, i)

    def send_backward(self, j: int, i: int) -> None:
        """SEND_B: send the gradients of stage ``j``'s inputs back to the stages that made them."""
        self.transport.send_backward(j, i, self._held.pop(("grad_in", j, i)))


def fused_pairs(clocked: list[list[list[Action]]]) -> dict[int, frozenset[int]]:
    """Return, per stage, the micro-batches whose ``W`` is the stage's next action after their ``I``.

    Nothing of the stage runs between them (a stage that sends its input gradients has its
    ``SEND_B`` there), so computing the weight gradients inside the ``I`` delays nothing of the
    stage's and saves re-reading their inputs in a separate ``W``.
    """
    fused: dict[int, set[int]] = {}
    previous: dict[int, Action] = {}
    for groups in clocked:
        for group in groups:
            for a in group:
                before = previous.get(a.stage)
                if a.kind == "W" and before is not None and before.kind == "I" and before.mb == a.mb:
                    fused.setdefault(a.stage, set()).add(a.mb)
                previous[a.stage] = a
    return {j: frozenset(mbs) for j, mbs in fused.items()}


def _lookahead(program: Program) -> dict[Action, int]:
    """Map each compute action to the micro-batch of its stage's next backward (``B`` or ``I``) after it."""
    ahead: dict[Action, int] = {}
    waiting: dict[int, list[Action]] = {}
    for groups in program.clocked:
        for group in groups:
            for a in group:
                if a.kind not in COMPUTE:
                    continue
                if a.kind in ("B", "I"):
                    for before in waiting.pop(a.stage, []):
                        ahead[before] = a.mb
                waiting.setdefault(a.stage, []).append(a)
    return ahead
