"""The timeline: forward, recompute, backward and copy events per stage and micro-batch, measured."""

import json

import pytest
import torch
import torch.nn.functional as F
from unet import UNet

import fxpipe
from fxpipe.runtime.observe import timeline as recorder

M, N = 3, 4


def _pipe(devices=("cpu",) * N, checkpoint="except_last"):
    model = UNet(depth=2, base=4)
    return fxpipe.compile(model, N, example_inputs=(torch.randn(6, 3, 8, 8),), chunks=M,
                          devices=list(devices), checkpoint=checkpoint)


def _step(pipe):
    x, y = torch.randn(6, 3, 8, 8), torch.randn(6, 2, 8, 8)
    return pipe.step(x, target=y, loss_fn=F.mse_loss)


def _events(tl, kind):
    return {(e["args"]["stage"], e["args"]["micro_batch"]): e for e in tl.events if e["cat"] == kind}


def _end(e):
    """Return an event's end in microseconds, less 1 ns for the rounding of ts + dur."""
    return e["ts"] + e["dur"] - 1e-3


def test_every_stage_and_micro_batch_has_forward_and_backward_on_its_lane(tmp_path):
    pipe = _pipe()
    path = tmp_path / "t.json"
    with fxpipe.timeline(str(path)) as tl:
        _step(pipe)
    pairs = {(j, i) for j in range(N) for i in range(M)}
    for kind in ("forward", "backward"):
        events = [e for e in tl.events if e["cat"] == kind]
        assert sorted((e["args"]["stage"], e["args"]["micro_batch"]) for e in events) == sorted(pairs)
        assert all(e["tid"] == e["args"]["stage"] and e["ph"] == "X" and e["dur"] >= 0 for e in events)
    # except_last: every micro-batch but the last is recomputed, on every stage
    assert set(_events(tl, "recompute")) == {(j, i) for j in range(N) for i in range(M - 1)}
    assert not _events(tl, "copy")  # one device: nothing to copy

    trace = json.loads(path.read_text())
    assert [e for e in trace["traceEvents"] if e["ph"] == "X"] == tl.events
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {j: f"stage {j} (cpu)" for j in range(N)}


def test_measured_order_is_the_gpipe_schedule():
    pipe = _pipe()
    with fxpipe.timeline() as tl:
        _step(pipe)
    fwd, bwd, rec = _events(tl, "forward"), _events(tl, "backward"), _events(tl, "recompute")
    for j in range(N):
        for i in range(M):
            if j + 1 < N:  # a micro-batch flows forward through the stages and back
                assert _end(fwd[j, i]) <= fwd[j + 1, i]["ts"]
                assert _end(bwd[j + 1, i]) <= bwd[j, i]["ts"]
            if i + 1 < M:  # a stage takes micro-batches in order, and backward in reverse order
                assert _end(fwd[j, i]) <= fwd[j, i + 1]["ts"]
                assert _end(bwd[j, i + 1]) <= bwd[j, i]["ts"]
            if (j, i) in rec:  # recomputation comes right before its backward, after all forwards
                assert _end(fwd[N - 1, M - 1]) <= rec[j, i]["ts"]
                assert _end(rec[j, i]) <= bwd[j, i]["ts"]
    # events on one lane are sequential or nested, never partly overlapping (Perfetto needs it)
    for tid in {e["tid"] for e in tl.events}:
        lane = sorted((e for e in tl.events if e["tid"] == tid), key=lambda e: e["ts"])
        for a, b in zip(lane, lane[1:]):
            assert _end(a) <= b["ts"] or _end(b) <= _end(a)


def test_copies_between_devices_are_events_on_the_receiving_stage():
    pipe = _pipe(devices=["cpu", "cpu:0", "cpu", "cpu:0"], checkpoint="never")
    with fxpipe.timeline() as tl:
        _step(pipe)
    copies = [e for e in tl.events if e["cat"] == "copy"]
    assert {(e["args"]["stage"], e["args"]["micro_batch"]) for e in copies} == \
        {(j, i) for j in range(1, N) for i in range(M)}
    assert all(e["tid"] == recorder.COPY_LANE + e["args"]["stage"] for e in copies)
    fwd = _events(tl, "forward")
    for e in copies:  # a copy into stage j precedes stage j's forward of that micro-batch
        assert _end(e) <= fwd[e["args"]["stage"], e["args"]["micro_batch"]]["ts"]
    assert not _events(tl, "recompute")
    assert "stage 1 copies in" in tl.lanes().values()


def test_inactive_timeline_adds_nothing():
    pipe = _pipe()
    assert recorder.active() is None
    assert recorder.span("forward", 0, 0, torch.device("cpu")) is recorder.span("copy", 1, 2)
    assert recorder.where() is None
    enter = recorder._Enter._backward_cls

    def marked(out):
        """Count the recorder's identity nodes in the output's autograd graph."""
        seen, stack = set(), [out.grad_fn]
        while stack:
            node = stack.pop()
            if node is not None and node not in seen:
                seen.add(node)
                stack += [f for f, _ in node.next_functions]
        return sum(type(node) is enter for node in seen)

    out = pipe(torch.randn(6, 3, 8, 8))
    assert marked(out) == 0  # no identity nodes of the recorder: the plain runtime's graph

    with fxpipe.timeline() as tl:
        _step(pipe)
    recorded = list(tl.events)
    _step(pipe)  # after the block: nothing more is recorded anywhere
    assert tl.events == recorded and recorder.active() is None
    with fxpipe.timeline() as tl2:
        out = pipe(torch.randn(6, 3, 8, 8))
    assert marked(out) == N * M  # one per stage call
    assert len(tl2.events) == N * M  # forward only: no backward ran


def test_eval_and_no_grad_record_forward_only():
    pipe = _pipe()
    with torch.no_grad(), fxpipe.timeline() as tl:
        pipe(torch.randn(6, 3, 8, 8))
    assert {e["cat"] for e in tl.events} == {"forward"} and len(tl.events) == N * M


def test_one_timeline_at_a_time():
    with fxpipe.timeline():
        with pytest.raises(RuntimeError, match="already recording"):
            with fxpipe.timeline():
                pass
    assert recorder.active() is None
