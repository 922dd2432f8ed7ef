"""Property tests: random DAG models equal eager for random stages, chunks and checkpoint modes.

Each example builds a model from a random program of ops over earlier values: linear layers,
activations, residual and long-range skips (add), concat merges, a branch that splits a value
in two (a tuple that may cross a stage boundary), one module called at several points, and a
weight tied between two layers. The pipeline (random ``n_stages``, ``chunks``, checkpoint mode
and devices, "cpu" and "cpu:0" being different devices to the planner) must equal eager, and
its plan must survive a JSON round trip. ``FXPIPE_PROPERTY_EXAMPLES=500`` runs more examples
(with fresh randomness); the default run is short and deterministic.
"""

import os

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from fxpipe.plan import PipelinePlan
from fxpipe.testing import SCHEDULES, assert_pipeline_equivalent

EXAMPLES = int(os.environ.get("FXPIPE_PROPERTY_EXAMPLES", "50"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None,
                    derandomize="FXPIPE_PROPERTY_EXAMPLES" not in os.environ,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
KINDS = ["linear", "act", "add", "cat", "shared", "tied", "branch"]
D = 6


class RandomDAG(nn.Module):
    """Run a program of (kind, src, other) ops; each op appends one (batch, D) value."""

    def __init__(self, program, outputs):
        super().__init__()
        self.program = program
        self.outputs = outputs
        self.shared = nn.Linear(D, D)
        self.base = nn.Linear(D, D)
        self.ops = nn.ModuleList()
        for kind, _, _ in program:
            if kind == "cat":
                self.ops.append(nn.Linear(2 * D, D))
            elif kind == "tied":
                layer = nn.Linear(D, D)
                layer.weight = self.base.weight  # tied: two layers, one Parameter
                self.ops.append(layer)
            else:
                self.ops.append(nn.Linear(D, D))

    def forward(self, x):
        values = [self.base(x)]
        for op, (kind, src, other) in zip(self.ops, self.program):
            a, b = values[src], values[other]
            if kind == "linear":
                y = op(a)
            elif kind == "act":
                y = torch.tanh(a)
            elif kind == "add":
                y = a + b
            elif kind == "cat":
                y = op(torch.cat([a, b], dim=-1))
            elif kind == "shared":
                y = self.shared(a)
            elif kind == "tied":
                y = F.gelu(op(a))
            else:  # branch: two halves, treated apart, merged again
                left, right = a.chunk(2, dim=-1)
                y = torch.cat([torch.tanh(left), right * 2], dim=-1)
            values.append(y)
        if len(self.outputs) == 1:
            return values[self.outputs[0]]
        return tuple(values[k] for k in self.outputs)


@st.composite
def dag_models(draw):
    """Draw a random program; sources reach back anywhere (long-range skips)."""
    n = draw(st.integers(3, 10))
    program = []
    for i in range(n):
        kind = draw(st.sampled_from(KINDS))
        src = draw(st.integers(0, i))
        other = draw(st.integers(0, i))
        program.append((kind, src, other))
    extra = draw(st.lists(st.integers(0, n - 1), max_size=1))
    return program, [n] + extra


@SETTINGS
@given(spec=dag_models(), data=st.data())
def test_random_dag_equals_eager(spec, data):
    program, outputs = spec
    torch.manual_seed(data.draw(st.integers(0, 2 ** 16), label="seed"))
    model = RandomDAG(program, outputs)
    n_compute = sum(1 for _ in program) + 1
    n_stages = data.draw(st.integers(1, min(4, n_compute)), label="n_stages")
    chunks = data.draw(st.integers(1, 4), label="chunks")
    checkpoint = data.draw(st.sampled_from(["always", "except_last", "never"]), label="checkpoint")
    devices = data.draw(st.lists(st.sampled_from(["cpu", "cpu:0"]), min_size=n_stages,
                                 max_size=n_stages), label="devices")
    batch = data.draw(st.integers(1, 6), label="batch")
    schedule = data.draw(st.sampled_from(SCHEDULES), label="schedule")  # of pipe.step
    x = torch.randn(batch, D)
    pipe = assert_pipeline_equivalent(model, (x,), n_stages=n_stages, chunks=chunks,
                                      checkpoint=checkpoint, devices=devices, schedules=[schedule])
    assert len(pipe.stages) == n_stages
    assert PipelinePlan.from_json(pipe.plan.to_json()) == pipe.plan
    for route in pipe.plan.skips:  # a skip goes straight from its producer to its consumer
        assert route.name in pipe.plan.stages[route.src].outputs
        assert route.name in pipe.plan.stages[route.dst].inputs
        assert all(route.name not in pipe.plan.stages[k].outputs for k in range(route.src + 1, route.dst))
