"""Record the pipeline's measured timeline and write it as a Chrome trace (Perfetto).

    with fxpipe.timeline("step.json"):
        pipe.step(x, target=y, loss_fn=F.cross_entropy)

Each stage gets a lane with a *forward*, a *recompute* (checkpointed micro-batches) and a
*backward* event per micro-batch, and a second lane with the *copy* events that bring values
to it from other devices: the GPipe diagram, measured. Forward, recompute and copy are spans
around the runtime's calls. Backward runs inside autograd, so it is found on the autograd
graph of each stage call::

    inputs ─▶ [ stage j, micro-batch i: autograd nodes ] ─▶ outputs ─▶ Enter ─▶ next stage
              └── a post-hook on every node stamps   ──┘            └─ its backward stamps
                  "still busy"; the last stamp is where                "backward begins"
                  backward ends

The walk over a stage's nodes stops at its inputs' nodes and at parameters (whose
accumulators all micro-batches share). On CUDA the stamps are CUDA events on the stream that
does the work, turned into host time when the timeline closes; on CPU they are
``time.perf_counter_ns``.

While no timeline records, :func:`span` returns one shared null context and
:func:`mark_backward` returns the outputs untouched: no hooks, no extra autograd nodes.
"""

from __future__ import annotations

import json
import threading
import time
from contextlib import nullcontext
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["Timeline", "active", "mark_backward", "span", "span_at", "timeline", "where"]

KINDS = ("forward", "recompute", "backward", "weight", "copy")
COPY_LANE = 1000  # copy lanes are tid COPY_LANE + stage

_active: Timeline | None = None
_NULL = nullcontext()
_local = threading.local()


def active() -> Timeline | None:
    """Return the timeline now recording, or None."""
    return _active


def timeline(path: str | None = None) -> Timeline:
    """Return a context manager recording the pipeline's timeline; write it to ``path`` on exit."""
    return Timeline(path)


class _Call:
    """One stage call on one micro-batch, with the stamps its backward leaves."""

    __slots__ = ("bw_begin", "bw_end", "device", "lock", "micro_batch", "recompute", "stage", "timeline")

    def __init__(self, tl: Timeline, stage: int, micro_batch: int, device: torch.device | None) -> None:
        self.timeline = tl
        self.stage, self.micro_batch, self.device = stage, micro_batch, device
        self.recompute: _Span | None = None
        self.bw_begin: Any = None
        self.bw_end: Any = None
        self.lock = threading.Lock()

    def backward_begins(self) -> None:
        """Stamp the start of this call's backward."""
        self.bw_begin = self.timeline.stamp(self.device)

    def backward_step(self, *_: Any) -> None:
        """Stamp that one of this call's autograd nodes finished (the last stamp wins)."""
        with self.lock:
            stamp = self.timeline.stamp(self.device, reuse=self.bw_end)
            self.bw_end = max(stamp, self.bw_end) if isinstance(self.bw_end, int) else stamp


class _Span:
    """A timed region of one kind for one stage and micro-batch."""

    __slots__ = (
        "begin",
        "call",
        "device",
        "end",
        "kind",
        "micro_batch",
        "previous",
        "stage",
        "stream",
        "timeline",
    )

    def __init__(self, tl: Timeline, kind: str, stage: int, micro_batch: int,
                 device: torch.device | None, stream: Any = None) -> None:
        self.timeline, self.kind, self.stage, self.micro_batch = tl, kind, stage, micro_batch
        self.device, self.stream = device, stream
        self.begin = self.end = None
        self.call: _Call | None = None

    def __enter__(self) -> _Call | None:
        if self.kind == "forward":
            self.call = _Call(self.timeline, self.stage, self.micro_batch, self.device)
            self.previous = getattr(_local, "call", None)
            _local.call = self.call
        self.begin = self.timeline.stamp(self.device, self.stream)
        return self.call

    def __exit__(self, *exc: object) -> None:
        self.end = self.timeline.stamp(self.device, self.stream)
        if self.kind == "forward":
            _local.call = self.previous
        self.timeline.spans.append(self)


def span(kind: str, stage: int, micro_batch: int, device: torch.device | None = None, stream: Any = None):
    """Time the block as a ``kind`` event of ``stage`` and ``micro_batch`` if a timeline records.

    A ``"forward"`` span's ``as`` target is the stage call, for :func:`mark_backward` and
    :func:`where`; otherwise (and when nothing records) it is None.
    """
    tl = _active
    if tl is None:
        return _NULL
    return _Span(tl, kind, stage, micro_batch, torch.device(device) if device is not None else None, stream)


def where() -> _Call | None:
    """Return the stage call whose forward span this thread is in, if a timeline records."""
    return getattr(_local, "call", None) if _active is not None else None


def span_at(kind: str, call: _Call | None):
    """Time the block as a ``kind`` event of the stage call ``call`` (from :func:`where`)."""
    if call is None or call.timeline is not _active:
        return _NULL
    s = _Span(call.timeline, kind, call.stage, call.micro_batch, call.device)
    if kind == "recompute":
        call.recompute = s
    return s


class _Enter(torch.autograd.Function):
    """Identity on a stage call's outputs; its backward stamps where the call's backward begins."""

    @staticmethod
    def forward(ctx, call: _Call, *tensors: torch.Tensor):  # type: ignore[override]
        ctx.call = call
        ctx.set_materialize_grads(False)
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        ctx.call.backward_begins()
        return (None,) + grads


def mark_backward(call: _Call | None, inputs: Any, outputs: Any) -> Any:
    """Hook the autograd graph of a stage call so its backward is timed; return the outputs.

    ``call`` is the ``as`` target of the call's forward :func:`span` (None when nothing
    records, and then ``outputs`` come back as they are).
    """
    if call is None or call.timeline is not _active or not torch.is_grad_enabled():
        return outputs
    leaves, spec = tree_flatten(outputs)
    idx = [k for k, v in enumerate(leaves) if isinstance(v, torch.Tensor) and v.requires_grad]
    if not idx:
        return outputs
    stop = {x.grad_fn for x in tree_flatten(inputs)[0] if isinstance(x, torch.Tensor) and x.grad_fn is not None}
    stack = [leaves[k].grad_fn for k in idx]
    seen: set = set()
    while stack:
        node = stack.pop()
        if node is None or node in seen or node in stop or hasattr(node, "variable"):
            continue  # hasattr(node, "variable"): a parameter's AccumulateGrad, shared by all calls
        seen.add(node)
        node.register_hook(call.backward_step)
        stack.extend(next_node for next_node, _ in node.next_functions)
    marked = _Enter.apply(call, *(leaves[k] for k in idx))
    for k, t in zip(idx, marked):
        leaves[k] = t
    return tree_unflatten(leaves, spec)


class Timeline:
    """Spans and backward stamps of the stage calls run while it records; a Chrome trace after."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path
        self.spans: list[_Span] = []
        self.events: list[dict[str, Any]] = []
        self._origin = 0
        self._refs: dict[torch.device, tuple[Any, int]] = {}

    # -- recording -------------------------------------------------------------------
    def __enter__(self) -> Timeline:  # noqa: PYI034 - typing.Self needs Python 3.11
        global _active
        if _active is not None:
            raise RuntimeError("a timeline is already recording; close it before starting another")
        self.spans, self.events, self._refs = [], [], {}
        self._origin = time.perf_counter_ns()
        _active = self
        return self

    def __exit__(self, *exc: object) -> None:
        global _active
        _active = None
        self.events = self._resolve()
        if self.path is not None and exc[0] is None:
            self.save(self.path)

    def stamp(self, device: torch.device | None, stream: Any = None, reuse: Any = None) -> Any:
        """Return a time stamp: a CUDA event on ``stream`` (or the current one), else host ns."""
        if device is None or device.type != "cuda":
            return time.perf_counter_ns()
        if device not in self._refs:
            torch.cuda.synchronize(device)
            ref = torch.cuda.Event(enable_timing=True)
            host = time.perf_counter_ns()
            ref.record(torch.cuda.current_stream(device))
            self._refs[device] = (ref, host)
        event = reuse if isinstance(reuse, torch.cuda.Event) else torch.cuda.Event(enable_timing=True)
        event.record(stream if stream is not None else torch.cuda.current_stream(device))
        return event

    # -- results -----------------------------------------------------------------------
    def _ns(self, device: torch.device | None, stamp: Any) -> int:
        """Turn a stamp into host nanoseconds."""
        if isinstance(stamp, int):
            return stamp
        assert device is not None  # a stamp that is an event was taken on a CUDA device
        ref, host = self._refs[device]
        return host + int(ref.elapsed_time(stamp) * 1e6)

    def _resolve(self) -> list[dict[str, Any]]:
        """Turn spans and backward stamps into Chrome trace events, sorted by start."""
        for cuda_device in self._refs:
            torch.cuda.synchronize(cuda_device)
        rows = [(s.kind, s.stage, s.micro_batch, s.device, self._ns(s.device, s.begin), self._ns(s.device, s.end))
                for s in self.spans]
        calls = {id(s.call): s.call for s in self.spans if s.call is not None}.values()
        for c in calls:
            if c.bw_begin is None or c.bw_end is None:
                continue
            begin, end = self._ns(c.device, c.bw_begin), self._ns(c.device, c.bw_end)
            if c.recompute is not None and c.recompute.end is not None:
                begin = max(begin, self._ns(c.device, c.recompute.end))  # recompute has its own event
            rows.append(("backward", c.stage, c.micro_batch, c.device, begin, max(begin, end)))
        events = []
        for kind, stage, mb, device, begin, end in sorted(rows, key=lambda r: r[4]):
            events.append({
                "name": f"{kind} {mb}", "cat": kind, "ph": "X", "pid": 0,
                "tid": stage + (COPY_LANE if kind == "copy" else 0),
                "ts": (begin - self._origin) / 1e3, "dur": (end - begin) / 1e3,
                "args": {"stage": stage, "micro_batch": mb, "device": str(device) if device else "cpu"},
            })
        return events

    def lanes(self) -> dict[int, str]:
        """Name each lane (tid) that has events."""
        names = {}
        for e in self.events:
            stage, device = e["args"]["stage"], e["args"]["device"]
            names[e["tid"]] = (f"stage {stage} copies in" if e["tid"] >= COPY_LANE
                               else f"stage {stage} ({device})")
        return dict(sorted(names.items()))

    def to_chrome_trace(self) -> dict[str, Any]:
        """Return the Chrome trace: ``traceEvents`` with one lane per stage (and its copies)."""
        meta: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "fxpipe"}}]
        for tid, name in self.lanes().items():
            order = 2 * (tid - COPY_LANE) + 1 if tid >= COPY_LANE else 2 * tid
            meta.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": name}})
            meta.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": tid,
                         "args": {"sort_index": order}})
        return {"traceEvents": meta + self.events, "displayTimeUnit": "ms"}

    def save(self, path: str) -> None:
        """Write the Chrome trace JSON to ``path`` (open it in https://ui.perfetto.dev)."""
        with open(path, "w") as f:
            json.dump(self.to_chrome_trace(), f)
