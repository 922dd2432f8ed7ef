"""The timeline on CUDA (fxpipe.runtime.observe.timeline): spans are CUDA events on the stream doing the
work, turned into host time when the timeline closes.

A GPU stage that busy-waits 20 ms per micro-batch shows it in its forward events, though
Python launches it in microseconds; the copy out of it to a CPU stage starts after that
forward ends (it is timed on the GPU's copy stream) and ends before the CPU stage begins::

    stage 0 (cuda:0)   [forward 0: 20 ms on the GPU]
    stage 1 copies in                                 [copy 0]
    stage 1 (cpu)                                             [forward 0]
"""

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.runtime.observe.timeline import COPY_LANE

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SLEEP_MS = 20
TOLERANCE_US = 500  # GPU and host clocks are aligned once per timeline, to within launch latency
DEVICES = ["cuda:0", "cpu", "cuda:0"]
M = 3


class Sleep(nn.Module):
    """Keep the GPU busy for SLEEP_MS before passing the input on (a leaf module)."""

    def __init__(self, sleep=None):
        super().__init__()
        self.sleep = sleep

    def forward(self, x):
        if x.is_cuda:
            self.sleep(SLEEP_MS)
        return x * 1.0


class Net(nn.Module):
    def __init__(self, sleep=None):
        super().__init__()
        self.a, self.slow, self.b, self.c = nn.Linear(32, 32), Sleep(sleep), nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x):
        return self.c(torch.relu(self.b(self.slow(torch.relu(self.a(x))))))


def _pipe(sleep, **kw):
    return fxpipe.compile(Net(sleep), 3, example_inputs=(torch.randn(6, 32),), chunks=M, devices=DEVICES,
                          split_points=["b", "c"], leaf_modules=[Sleep], **kw)


def _events(tl, kind):
    return {(e["args"]["stage"], e["args"]["micro_batch"]): e for e in tl.events if e["cat"] == kind}


def _end(e):
    return e["ts"] + e["dur"]


def _step(pipe):
    return pipe.step(torch.randn(6, 32), target=torch.randn(6, 32), loss_fn=F.mse_loss)


def test_gpu_forward_events_measure_gpu_time(cuda_sleep, tmp_path):
    pipe = _pipe(cuda_sleep)
    path = tmp_path / "gpu.json"
    with fxpipe.timeline(str(path)) as tl:
        _step(pipe)
    forward = _events(tl, "forward")
    assert set(forward) == {(j, i) for j in range(3) for i in range(M)}
    for (j, i), e in forward.items():
        assert e["args"]["device"] == DEVICES[j]
        if j == 0:
            assert e["dur"] >= 0.8 * SLEEP_MS * 1e3, e  # the GPU's time, not the launch's
    for kind in ("backward", "recompute"):
        events = _events(tl, kind)
        pairs = {(j, i) for j in range(3) for i in range(M if kind == "backward" else M - 1)}
        assert set(events) == pairs, kind  # except_last: every micro-batch but the last recomputes
        assert all(e["dur"] >= 0 and e["args"]["device"] == DEVICES[e["args"]["stage"]] for e in events.values())
    for i in range(M - 1):  # stage 0's forwards run one after another on one stream
        assert forward[(0, i + 1)]["ts"] >= _end(forward[(0, i)]) - 1
    names = {e["tid"]: e["args"]["name"] for e in json.loads(path.read_text())["traceEvents"]
             if e["name"] == "thread_name"}
    assert names[0] == "stage 0 (cuda:0)" and names[1] == "stage 1 (cpu)"
    assert names[COPY_LANE + 1] == "stage 1 copies in"


def test_copies_are_timed_between_the_forwards_they_connect(cuda_sleep):
    pipe = _pipe(cuda_sleep, checkpoint="never")
    with fxpipe.timeline() as tl:
        pipe(torch.randn(6, 32))
    forward, copies = _events(tl, "forward"), _events(tl, "copy")
    assert set(copies) == {(j, i) for j in (1, 2) for i in range(M)}
    for (j, i), c in copies.items():
        assert c["tid"] == COPY_LANE + j
        assert c["args"]["device"] == "cuda:0"  # timed on the GPU side of the copy
        assert c["ts"] >= _end(forward[(j - 1, i)]) - TOLERANCE_US, (j, i)
        assert _end(c) <= forward[(j, i)]["ts"] + TOLERANCE_US, (j, i)
    # the copy out of the sleeping stage is not stretched over the sleep
    assert all(copies[(1, i)]["dur"] < 0.5 * SLEEP_MS * 1e3 for i in range(M))


@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_action_schedules_record_gpu_events(cuda_sleep, schedule):
    pipe = _pipe(cuda_sleep, schedule=schedule)
    with fxpipe.timeline() as tl:
        _step(pipe)
    forward, backward = _events(tl, "forward"), _events(tl, "backward")
    pairs = {(j, i) for j in range(3) for i in range(M)}
    assert set(forward) == set(backward) == pairs
    assert all(forward[(0, i)]["dur"] >= 0.8 * SLEEP_MS * 1e3 for i in range(M))
    if schedule == "zb":
        assert set(_events(tl, "weight")) == pairs
