"""Walk a simulated step and account each stage's memory as its actions take and free it.

Per micro-batch ``i`` of stage ``j`` (bytes from :class:`~fxpipe.simulate.stagecost.StageCost`)::

    after F     + kept                  (checkpointed micro-batches: + inputs instead)
    during B/I  + kept, recomputed      (checkpointed only) + transient (the backward's workspace)
    after B     - what F added
    after I     - what F added, + wstore    (the linears' inputs and output gradients W needs)
    after W     - wstore
    first backward of the stage: + grads, held to the end of the step

Across ranks messages hold memory too, each receive posted one micro-batch ahead
(``ahead_f``, ``ahead_b`` during F and B), and a send held until the peer is known to have it
(the runtime lets a send go when the peer sends something after receiving it): the values a
stage sends (``pinned_f``) until the gradients of that micro-batch come back, at its B or I;
the gradients it sends back (``pinned_b``) until its next input that the stage before sent
after starting that micro-batch's backward (or the end of the step).

A device holding several stages (one process on one CPU, or several stages per rank) adds
theirs up in the order the actions run, so its peak is the most that is live at once, not the
sum of each stage's peak. Parameters, gradients and optimizer state sit on top (:class:`Memory`).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from fxpipe.simulate.eventsim import Span
from fxpipe.simulate.stagecost import StageCost

__all__ = ["OPTIMIZER_STATES", "Memory", "walk"]

# Bytes of optimizer state per byte of trainable parameters: SGD with momentum keeps one
# buffer, Adam two (its moments, in the parameters' dtype).
OPTIMIZER_STATES = {"none": 0.0, "sgd": 0.0, "momentum": 1.0, "adam": 2.0, "adamw": 2.0}


@dataclass
class Memory:
    """A stage's (or device's) peak memory in bytes, and what it is made of."""

    params: float = 0.0  # parameters and buffers
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0  # the most activations (and backward workspace) live at once
    growth: float = 0.0  # the most a step adds over what is live before it: gradients + activations

    @property
    def peak(self) -> float:
        """Return the peak: state plus the most activations live at once."""
        return self.params + self.grads + self.optimizer + self.activations


def walk(spans: Sequence[Span], costs: Sequence[StageCost], stop: int | Sequence[int], device_of: Sequence[int],
         optimizer: str = "none") -> tuple[list[Memory], dict[int, Memory]]:
    """Return each stage's :class:`Memory` and each device's, from the spans of one step.

    Micro-batches below ``stop`` (one number, or one per stage) are checkpointed; ``device_of[j]``
    names stage ``j``'s device. A selective or offloaded stage comes with its costs set for it
    (:func:`fxpipe.simulate.stagecost.under`): what it keeps, and what its backward adds.
    """
    states = OPTIMIZER_STATES.get(optimizer)
    if states is None:
        raise ValueError(f"optimizer={optimizer!r}; use one of {', '.join(map(repr, OPTIMIZER_STATES))}")
    n = len(costs)
    stops = [stop] * n if isinstance(stop, int) else list(stop)
    live = [0.0] * n  # activations held per stage
    peak = [0.0] * n
    growth = [0.0] * n
    grads_on = [False] * n
    held: dict[tuple[int, int], float] = {}
    devices = sorted(set(device_of))
    dev_live = {d: 0.0 for d in devices}
    dev_peak = {d: 0.0 for d in devices}
    dev_growth = {d: 0.0 for d in devices}
    dev_grads = {d: 0.0 for d in devices}  # gradients live on each device (its stages past their first backward)

    def note(j: int, extra: float) -> None:
        """Record stage ``j``'s live bytes (plus ``extra`` in flight) as a candidate peak."""
        d = device_of[j]
        peak[j] = max(peak[j], live[j] + extra)
        growth[j] = max(growth[j], live[j] + extra + (costs[j].grads if grads_on[j] else 0.0))
        dev_peak[d] = max(dev_peak[d], dev_live[d] + extra)
        dev_growth[d] = max(dev_growth[d], dev_live[d] + extra + dev_grads[d])

    def add(j: int, nbytes: float) -> None:
        """Change stage ``j``'s live activations by ``nbytes``."""
        live[j] += nbytes
        dev_live[device_of[j]] += nbytes

    let_go = _grads_let_go(spans)
    pinned_b: dict[tuple[int, int], float] = {}  # (stage, micro-batch whose F lets them go) -> bytes
    for span in sorted(spans, key=lambda s: (s.start, s.end)):
        a, c = span.action, costs[span.action.stage]
        j, i = a.stage, a.mb
        ckpt = i < stops[j]
        if a.kind == "F":
            add(j, -pinned_b.pop((j, i), 0.0))
            note(j, c.ahead_f + (c.inputs if ckpt else 0.0))
            held[(j, i)] = c.inputs + c.pinned_f if ckpt else c.kept  # the sent outputs are among those kept
            add(j, held[(j, i)])
            note(j, 0.0)
        elif a.kind in ("B", "I"):
            if not grads_on[j]:
                grads_on[j] = True
                dev_grads[device_of[j]] += c.grads
            note(j, (c.kept if ckpt else 0.0) + c.transient + c.ahead_b)
            add(j, -held.pop((j, i), 0.0) + (c.wstore if a.kind == "I" else 0.0) + c.pinned_b)
            if (j, i) in let_go:
                key = (j, let_go[(j, i)])
                pinned_b[key] = pinned_b.get(key, 0.0) + c.pinned_b
            note(j, 0.0)
        elif a.kind == "W":
            note(j, c.transient / 2)
            add(j, -c.wstore)
    stages = [Memory(c.params, c.grads, states * c.grads, peak[j], growth[j]) for j, c in enumerate(costs)]
    per_device = {}
    for d in devices:
        mine = [j for j in range(n) if device_of[j] == d]
        per_device[d] = Memory(sum(costs[j].params for j in mine), sum(costs[j].grads for j in mine),
                               sum(states * costs[j].grads for j in mine), dev_peak[d], dev_growth[d])
    return stages, per_device


def _grads_let_go(spans: Sequence[Span]) -> dict[tuple[int, int], int]:
    """Map (stage j, micro-batch i) to the micro-batch whose F on stage j lets j's gradients of i go.

    Stage ``j`` sends micro-batch ``i``'s input gradients to stage ``j - 1``; they go once an
    input arrives that ``j - 1`` sent after starting ``i``'s backward: the first ``F`` of stage
    ``j - 1`` ending after that start. Absent: held to the end of the step.
    """
    back: dict[tuple[int, int], float] = {}
    ends: dict[int, list[tuple[float, int]]] = {}  # stage -> its forwards' (end, micro-batch), by end
    for s in spans:
        a = s.action
        if a.kind in ("B", "I"):
            back[(a.stage, a.mb)] = s.start
        elif a.kind == "F":
            ends.setdefault(a.stage, []).append((s.end, a.mb))
    for row in ends.values():
        row.sort()
    out = {}
    for (j, i) in back:
        if j == 0 or (j - 1, i) not in back:
            continue
        row = ends.get(j - 1, [])
        k = bisect.bisect_left(row, (back[(j - 1, i)], -1))
        if k < len(row):
            out[(j, i)] = row[k][1]
    return out
