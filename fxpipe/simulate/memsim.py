"""Walk a simulated step and account each stage's memory as its actions take and free it.

Per micro-batch ``i`` of stage ``j`` (bytes from :class:`~fxpipe.simulate.stagecost.StageCost`)::

    after F     + kept                  (checkpointed micro-batches: + inputs instead)
    during B/I  + kept, recomputed      (checkpointed only) + transient (the backward's workspace)
                + accumulate            (a B after the stage's first: a fresh weight gradient)
    after B     - what F added
    after I     - what F added, + wstore    (the linears' inputs and output gradients W needs)
    after W     - wstore
    first backward of the stage: + grads, held to the end of the step (the deferred linears' at
                the first W, which adds into them in place)

Across ranks messages hold memory too, each receive posted one micro-batch ahead
(``ahead_f``, ``ahead_b`` during F and B), and a send held until the peer is known to have it
(the runtime lets a send go when the peer sends something after receiving it): the values a
stage sends (``pinned_f``) until the gradients of that micro-batch come back, at its B or I;
the gradients it sends back (``pinned_b``) until its next input that the stage before sent
after starting that micro-batch's backward (or the end of the step). On CPU the runtime keeps
its receive buffers from step to step (``pooled``): they are there before a step starts, so the
step's growth leaves them out and its peak counts the most of them in use at once.

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
         optimizer: str = "none", pooled: bool = False) -> tuple[list[Memory], dict[int, Memory]]:
    """Return each stage's :class:`Memory` and each device's, from the spans of one step.

    Micro-batches below ``stop`` (one number, or one per stage) are checkpointed; ``device_of[j]``
    names stage ``j``'s device. A selective or offloaded stage comes with its costs set for it
    (:func:`fxpipe.simulate.stagecost.under`): what it keeps, and what its backward adds.

    ``pooled``: received values land in buffers the runtime keeps from step to step (on CPU), so
    a step's growth leaves out the received bytes in use, and the peak counts the most of them
    in use at once as there throughout.
    """
    states = OPTIMIZER_STATES.get(optimizer)
    if states is None:
        raise ValueError(f"optimizer={optimizer!r}; use one of {', '.join(map(repr, OPTIMIZER_STATES))}")
    n = len(costs)
    stops = [stop] * n if isinstance(stop, int) else list(stop)
    live = [0.0] * n  # activations held per stage
    peak = [0.0] * n
    growth = [0.0] * n
    grads = [0.0] * n  # the gradients stage j holds so far this step
    backed = [False] * n  # the stage has run a backward (B or I) this step
    weighed = [False] * n  # ... and a W
    held: dict[tuple[int, int], float] = {}
    devices = sorted(set(device_of))
    dev_live = {d: 0.0 for d in devices}
    dev_peak = {d: 0.0 for d in devices}
    dev_growth = {d: 0.0 for d in devices}
    dev_grads = {d: 0.0 for d in devices}  # gradients live on each device (its stages past their first backward)
    # received bytes in use (pooled: the buffers outlive the step, so a step's growth leaves them out)
    got = [0.0] * n
    got_held: dict[tuple[int, int], float] = {}  # (stage, micro-batch) -> received bytes held from F to B/I
    got_stored: dict[tuple[int, int], float] = {}  # ... from I to W (a deferred linear's received input)
    dev_got = {d: 0.0 for d in devices}
    pool = [0.0] * n  # the most received bytes in use at once
    dev_pool = {d: 0.0 for d in devices}

    def note(j: int, extra: float, received: float = 0.0) -> None:
        """Record stage ``j``'s live bytes (plus ``extra`` in flight, ``received`` of it received) as a peak."""
        d = device_of[j]
        pool[j] = max(pool[j], got[j] + received)
        dev_pool[d] = max(dev_pool[d], dev_got[d] + received)
        own = (got[j] + received) if pooled else 0.0
        dev_own = (dev_got[d] + received) if pooled else 0.0
        peak[j] = max(peak[j], live[j] + extra - own)
        growth[j] = max(growth[j], live[j] + extra - own + grads[j])
        dev_peak[d] = max(dev_peak[d], dev_live[d] + extra - dev_own)
        dev_growth[d] = max(dev_growth[d], dev_live[d] + extra - dev_own + dev_grads[d])

    def gain(j: int, nbytes: float) -> None:
        """Add ``nbytes`` of gradients to stage ``j``'s (held to the end of the step)."""
        grads[j] += nbytes
        dev_grads[device_of[j]] += nbytes

    def add(j: int, nbytes: float, received: float = 0.0) -> None:
        """Change stage ``j``'s live activations by ``nbytes``, ``received`` of them received."""
        live[j] += nbytes
        dev_live[device_of[j]] += nbytes
        got[j] += received
        dev_got[device_of[j]] += received

    let_go = _grads_let_go(spans)
    pinned_b: dict[tuple[int, int], float] = {}  # (stage, micro-batch whose F lets them go) -> bytes
    for span in sorted(spans, key=lambda s: (s.start, s.end)):
        a, c = span.action, costs[span.action.stage]
        j, i = a.stage, a.mb
        ckpt = i < stops[j]
        if a.kind == "F":
            add(j, -pinned_b.pop((j, i), 0.0))
            note(j, c.ahead_f + (c.inputs if ckpt else 0.0), c.ahead_f)
            held[(j, i)] = c.inputs + c.pinned_f if ckpt else c.kept  # the sent outputs are among those kept
            got_held[(j, i)] = c.ahead_f  # this micro-batch's inputs from other ranks, among those held
            add(j, held[(j, i)], got_held[(j, i)])
            note(j, 0.0)
        elif a.kind in ("B", "I"):
            if not backed[j]:
                gain(j, c.grads if a.kind == "B" else c.grads - c.grads_w)  # deferred linears': at the first W
            fresh = (c.accumulate if a.kind == "B" else c.accumulate_i) if backed[j] else 0.0  # to add to the held
            backed[j] = True
            note(j, (c.kept if ckpt else 0.0) + c.transient + fresh + c.ahead_b, c.ahead_b)
            stored = min(c.wstore_in, c.ahead_f) if a.kind == "I" else 0.0  # received inputs W still reads
            if stored:
                got_stored[(j, i)] = stored
            add(j, -held.pop((j, i), 0.0) + (c.wstore if a.kind == "I" else 0.0) + c.pinned_b,
                stored - got_held.pop((j, i), 0.0))
            if (j, i) in let_go:
                key = (j, let_go[(j, i)])
                pinned_b[key] = pinned_b.get(key, 0.0) + c.pinned_b
            note(j, 0.0)
        elif a.kind == "W":
            if not weighed[j]:
                weighed[j] = True
                gain(j, c.grads_w)
            note(j, c.transient / 2)  # W adds into .grad in place (addmm_): no fresh gradient
            add(j, -c.wstore, -got_stored.pop((j, i), 0.0))
    if pooled:  # the pool's buffers are there at the peak, in use or idle
        peak = [p + q for p, q in zip(peak, pool)]
        dev_peak = {d: dev_peak[d] + dev_pool[d] for d in devices}
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
