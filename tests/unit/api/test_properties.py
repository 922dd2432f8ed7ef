"""Property tests: random DAG models equal eager for random stages, chunks and checkpoint modes.

Each example builds a model from a random program of ops over earlier values: linear layers,
activations, residual and long-range skips (add), concat merges, a branch that splits a value
in two (a tuple that may cross a stage boundary), one module called at several points, and a
weight tied between two layers. The pipeline (random ``n_stages``, ``chunks``, checkpoint mode
and devices, "cpu" and "cpu:0" being different devices to the planner) must equal eager, and
its plan must survive a JSON round trip. ``FXPIPE_PROPERTY_EXAMPLES=500`` runs more examples
(with fresh randomness); the default run is short and deterministic.

A second property adds in-place ops (``mul_``, index assignment, in-place ReLU, ``masked_fill_``)
on earlier values and values that are not tensors (``None``, a string, a float, an integer
tensor, the row count) to the programs, traced by fx or by torch.export: wherever eager runs
(an in-place op may break eager's own backward; such programs are skipped), the
automatically cut pipeline equals it, ``pipe(x)`` and ``pipe.step``, or is refused with
``MutationError`` when no cut keeps every in-place op in the stage of the values it changes.
"""

import os

import pytest
import torch
import torch.nn.functional as F
from fxpipe.passes.cost import COMPUTE_OPS
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import nn

import fxpipe
from fxpipe import passes
from fxpipe.options import SINGLE_STAGE_SCHEDULES as SCHEDULES
from fxpipe.plan.pipeline import PipelinePlan
from fxpipe.testing import assert_pipeline_equivalent

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


@pytest.mark.slow  # about 2 s or more: left out of the fast loop
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


MUTATIONS = ["mul_", "setitem", "relu_", "masked_fill_"]
MIXED_KINDS = ["linear", "act", "add", "pack", "unpack"] + MUTATIONS
MIXED_EXAMPLES = max(EXAMPLES * 2 // 5, 1)  # 20 by default: each may export twice


class Pack(nn.Module):
    """Return a tuple of mixed values; a leaf module, so fx keeps it as one node of tuple value."""

    def forward(self, a):
        return a, None, "tanh", 2.0, a.argmax(-1)


class MixedDAG(nn.Module):
    """Run a program whose ops may change earlier values in place or carry non-tensor values.

    ``pack`` makes a tuple value (a leaf module: one fx node whose value holds ``None``, a
    string, a float and an integer tensor); every op that reads it unpacks each field.
    """

    def __init__(self, program, outputs):
        super().__init__()
        self.program, self.outputs = program, outputs
        self.base = nn.Linear(D, D)
        self.ops = nn.ModuleList(nn.Linear(D, D) for _ in program)
        self.pack = Pack()

    def forward(self, x):
        values = [self.base(x)]
        packed = [False]  # known from the program: an isinstance check would see an fx Proxy
        rows = x.shape[0]
        for op, (kind, src, other) in zip(self.ops, self.program):
            a, b = _tensor(values[src], packed[src]), _tensor(values[other], packed[other])
            if kind == "linear":
                y = op(a)
            elif kind == "act":
                y = torch.tanh(a)
            elif kind == "add":
                y = a + b
            elif kind == "pack":
                y = self.pack(a)
            elif kind == "unpack":  # the row count, an int, crosses too
                y = op(a).reshape(rows, -1)
            elif kind == "mul_":
                y = a.mul_(2)
            elif kind == "setitem":
                a[:, 0] = 0.5
                y = b * 1
            elif kind == "relu_":
                y = F.relu(a, inplace=True)
            else:
                y = a.masked_fill_(b > 0.5, 0.5)
            values.append(y)
            packed.append(kind == "pack")
        return tuple(_tensor(values[k], packed[k]) for k in self.outputs)


def _tensor(value, packed):
    """Turn a packed tuple back into a (batch, D) tensor, using each of its fields."""
    if not packed:
        return value
    a, none, approx, scale, idx = value[0], value[1], value[2], value[3], value[4]
    h = torch.clamp(F.gelu(a * scale, approximate=approx), min=none, max=4 * scale)
    return h + F.one_hot(idx, D).to(a.dtype)


@st.composite
def mixed_models(draw):
    """Draw a program with in-place ops and packed values; sources reach back anywhere."""
    n = draw(st.integers(3, 8))
    program = [(draw(st.sampled_from(MIXED_KINDS)), draw(st.integers(0, i)), draw(st.integers(0, i)))
               for i in range(n)]
    return program, [n] + draw(st.lists(st.integers(0, n - 1), max_size=1))


def _eager_runs(model, x):
    """Tell whether eager forward and backward run (an in-place op may break eager's backward)."""
    try:
        sum(t.sum() for t in model(x.clone())).backward()
    except RuntimeError as exc:
        if "inplace operation" in str(exc) or "a view of a leaf" in str(exc):
            return False
        raise
    model.zero_grad(set_to_none=True)
    return True


@pytest.mark.slow  # about 2 s or more: left out of the fast loop
@settings(SETTINGS, max_examples=MIXED_EXAMPLES)
@given(spec=mixed_models(), data=st.data())
def test_random_dag_with_in_place_ops_and_non_tensor_values_equals_eager(spec, data):
    program, outputs = spec
    torch.manual_seed(data.draw(st.integers(0, 2 ** 16), label="seed"))
    model = MixedDAG(program, outputs).eval()
    x = torch.randn(data.draw(st.integers(2, 5), label="batch"), D)
    assume(_eager_runs(model, x))
    tracer = data.draw(st.sampled_from(["fx", "export"]), label="tracer")
    n_stages = data.draw(st.integers(1, 3), label="n_stages")
    kwargs = dict(leaf_modules=[Pack]) if tracer == "fx" else {}
    try:
        assert_pipeline_equivalent(model, (x,), n_stages=n_stages, tracer=tracer,
                                   chunks=data.draw(st.integers(1, 3), label="chunks"),
                                   checkpoint=data.draw(st.sampled_from(["always", "except_last", "never"]),
                                                        label="checkpoint"),
                                   devices=["cpu"] * n_stages,
                                   schedules=[data.draw(st.sampled_from(SCHEDULES), label="schedule")],
                                   **kwargs)
    except fxpipe.MutationError:
        # refused only when keeping every in-place op with what it changes leaves too few cuts
        gm = passes.annotate(fxpipe.trace(model, tracer=tracer, example_inputs=(x,), **kwargs), (x,))
        order = [n for n in gm.graph.nodes if n.op in COMPUTE_OPS]
        assert len(order) - len(passes.inplace.joined_positions(gm, order)) < n_stages
