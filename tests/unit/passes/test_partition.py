"""Partition: optimal over its order and no worse than the traced order's best, non-empty stages,
forward dependencies, the memory cap respected or refused, split points."""

import itertools

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from models import MLP
from torch import nn
from unet import UNet

import fxpipe
from fxpipe import passes


@st.composite
def random_dags(draw):
    """A random DAG GraphModule whose nodes carry random costs, bytes and parameter reads."""
    root = nn.Module()
    root.w = nn.Parameter(torch.ones(()))
    graph = torch.fx.Graph()
    values = [graph.placeholder("x")]
    weight = graph.get_attr("w")
    for _ in range(draw(st.integers(2, 8))):
        a = values[draw(st.integers(0, len(values) - 1))]
        kind = draw(st.sampled_from(["tanh", "add", "mul_w"]))
        if kind == "add":
            b = values[draw(st.integers(0, len(values) - 1))]
            values.append(graph.call_function(torch.add, (a, b)))
        elif kind == "mul_w":
            values.append(graph.call_function(torch.mul, (a, weight)))
        else:
            values.append(graph.call_function(torch.tanh, (a,)))
    extra = draw(st.lists(st.integers(1, len(values) - 1), max_size=2))
    graph.output(tuple([values[-1]] + [values[i] for i in extra]))
    if not weight.users:
        graph.erase_node(weight)
    gm = torch.fx.GraphModule(root, graph)
    for node in gm.graph.nodes:
        node.meta["fxpipe.bytes"] = draw(st.integers(0, 40)) if node.op != "get_attr" else 0
        node.meta["fxpipe.flops"] = draw(st.integers(0, 30)) if node.op == "call_function" else 0
        node.meta["fxpipe.flops_bwd"] = 0
        node.meta["fxpipe.saved_bytes"] = node.meta["fxpipe.bytes"] if node.op == "call_function" else 0
        node.meta["fxpipe.param_bytes"] = draw(st.integers(1, 20)) if node.op == "get_attr" else 0
    return gm


def _widths(gm, order):
    """Bytes crossing each cut of ``order``, computed straight from the definition."""
    pos = {n: i for i, n in enumerate(order)}
    n = len(order)
    widths = [sum(p.meta["fxpipe.bytes"] for p in gm.graph.nodes if p.op == "placeholder")]
    for cut in range(1, n):
        total = 0
        for v in gm.graph.nodes:
            if v.op in ("get_attr", "output"):
                continue
            made = -1 if v.op == "placeholder" else pos[v]
            if made < cut and any(pos.get(u, n) >= cut for u in v.users):
                total += v.meta["fxpipe.bytes"]
        widths.append(total)
    return widths + [0]


def _stage_costs(gm, order, starts, beta):
    widths, n, k = _widths(gm, order), len(order), len(starts)
    bounds = list(starts) + [n]
    costs = []
    for j in range(k):
        a, b = bounds[j], bounds[j + 1]
        cost = sum(node.meta["fxpipe.flops"] for node in order[a:b])
        cost += (beta * widths[a] if j > 0 else 0) + (beta * widths[b] if j < k - 1 else 0)
        costs.append(cost)
    return costs


def _memory(gm, order, starts, f_act, f_in):
    widths, bounds = _widths(gm, order), list(starts) + [len(order)]
    out = []
    for j in range(len(starts)):
        nodes = order[bounds[j]:bounds[j + 1]]
        params = sum(a.meta["fxpipe.param_bytes"] for node in nodes for a in node.all_input_nodes
                     if a.op == "get_attr")
        out.append(2 * params + f_act * sum(node.meta["fxpipe.saved_bytes"] for node in nodes)
                   + f_in * widths[bounds[j]])
    return out


def _best(gm, order, k, beta, cap=None, factors=(1.0, 0.0)):
    best = None
    for cuts in itertools.combinations(range(1, len(order)), k - 1):
        starts = [0, *cuts]
        if cap is not None and max(_memory(gm, order, starts, *factors)) > cap:
            continue
        value = max(_stage_costs(gm, order, starts, beta))
        best = value if best is None else min(best, value)
    return best


def _check_stages(gm, k):
    """Every stage holds a compute node and every value flows to the same or a later stage."""
    compute = passes.compute_nodes(gm)
    assert {n.meta["fxpipe.stage"] for n in compute} == set(range(k))
    for node in gm.graph.nodes:
        for a in node.all_input_nodes:
            if a.op != "get_attr":
                assert a.meta["fxpipe.stage"] <= node.meta["fxpipe.stage"], (a.name, node.name)
    modules, stages, _ = passes.split(gm, k)
    assert len(modules) == len(stages) == k


@settings(max_examples=150, deadline=None)
@given(random_dags(), st.integers(1, 4), st.sampled_from([0.0, 0.5, 2.0]))
def test_optimal_over_its_order_and_no_worse_than_traced(gm, k, beta):
    order0 = passes.compute_nodes(gm)
    assume(any(n.meta["fxpipe.flops"] for n in order0))  # all-zero costs fall back to node counts
    k = min(k, len(order0))
    cut = passes.partition(gm, k, balance_by="flops", comm=beta)
    assert passes.order.is_topological(cut.order) and set(cut.order) == set(order0)
    value = max(_stage_costs(gm, cut.order, cut.starts, beta))
    assert value == pytest.approx(max(cut.costs), rel=1e-9)
    assert value == pytest.approx(_best(gm, cut.order, k, beta), rel=1e-9)
    assert value <= _best(gm, order0, k, beta) * (1 + 1e-9)
    _check_stages(gm, k)


@settings(max_examples=150, deadline=None)
@given(random_dags(), st.integers(1, 4), st.integers(0, 200),
       st.sampled_from(["never", "except_last", "always"]), st.integers(1, 4))
def test_memory_cap_respected_or_refused(gm, k, cap, checkpoint, micro):
    order0 = passes.compute_nodes(gm)
    k = min(k, len(order0))
    factors = passes.memory_factors(checkpoint, micro)
    try:
        cut = passes.partition(gm, k, max_memory=cap, checkpoint=checkpoint, micro_batches=micro)
    except passes.NoFeasibleCut as exc:
        assert f"max_memory={cap} bytes fits no cut into {k} stages" in str(exc)
        assert exc.least > cap
        assert _best(gm, order0, k, 0.0, cap, factors) is None  # the traced order has none either
        return
    assert max(_memory(gm, cut.order, cut.starts, *factors)) <= cap + 1e-9
    assert cut.memory == pytest.approx(_memory(gm, cut.order, cut.starts, *factors), rel=1e-9, abs=1e-9)
    _check_stages(gm, k)


def test_flop_balance_on_unet_near_the_traced_optimum():
    model = UNet(depth=3, base=8).eval()
    gm = passes.annotate(fxpipe.trace(model), (torch.randn(8, 3, 32, 32),))
    costs = passes.node_costs(passes.compute_nodes(gm), "flops")
    for k in (2, 3, 4):
        best = max(passes.group_costs(costs, [0] * (len(costs) + 1), passes.balanced_cut(costs, k)))
        cut = passes.partition(gm, k)
        assert max(cut.costs) <= best * (1 + 1e-9)
        _check_stages(gm, k)


def _compile_unet(**kwargs):
    return fxpipe.compile(UNet(depth=3, base=4).eval(), 3, example_inputs=(torch.randn(4, 3, 16, 16),),
                          chunks=2, checkpoint="never", devices=["cpu"] * 3, **kwargs)


def _least_memory():
    with pytest.raises(fxpipe.NoFeasibleCut) as info:
        _compile_unet(max_memory=1)
    return info.value.least


def test_compile_respects_max_memory_down_to_the_least_that_fits():
    least = _least_memory()
    free = max(s.memory for s in _compile_unet().plan.stages)
    capped = max(s.memory for s in _compile_unet(max_memory=least * (1 + 1e-9)).plan.stages)
    assert capped <= least * (1 + 1e-9) < free


def test_balance_by_memory_reaches_the_least_memory():
    least = _least_memory()
    plan = _compile_unet(balance_by="memory").plan
    assert max(s.cost for s in plan.stages) == pytest.approx(least, rel=1e-9)
    assert max(s.memory for s in plan.stages) <= least * (1 + 1e-9)
    assert "bottleneck (max/mean memory)" in str(plan)


def test_compile_refuses_an_impossible_cap_and_leaves_the_model_alone():
    model = MLP()
    params = [p.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"max_memory=100 bytes fits no cut into 2 stages: the least "
                                         r"possible largest stage needs [0-9.e+]+ bytes .* raise max_memory"):
        fxpipe.compile(model, 2, example_inputs=(torch.randn(4, 16),), max_memory=100)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    with pytest.raises(ValueError, match="needs example_inputs"):
        fxpipe.compile(MLP(), 2, max_memory=10**9)
    with pytest.raises(ValueError, match="max_memory=-1; use a positive number"):
        fxpipe.compile(MLP(), 2, max_memory=-1)
    with pytest.raises(TypeError, match="max_memory must be a number"):
        fxpipe.compile(MLP(), 2, max_memory="1GB")


# -- split points -----------------------------------------------------------------------------

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3)])
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(torch.tanh(x))


def _stage_nodes(pipe):
    return [[n for n in s.nodes] for s in pipe.plan.stages]


def test_split_points_begin_stages_at_modules_and_nodes():
    model, x = Net(), torch.randn(4, 8)
    pipe = fxpipe.compile(model, 3, example_inputs=(x,), split_points=["blocks.1", "tanh"], devices=["cpu"] * 3)
    nodes = _stage_nodes(pipe)
    assert nodes[1][0] == "blocks_1_0" and nodes[2][0] == "tanh"
    assert "blocks_0_1" in nodes[0] and "blocks_2_1" in nodes[1]
    torch.testing.assert_close(pipe(x), model(x))
    # a container's first call, a nested module, a call_module node's name
    pipe = fxpipe.compile(Net(), 3, example_inputs=(x,), split_points=["blocks", "blocks.2.1"],
                          devices=["cpu"] * 3)
    assert _stage_nodes(pipe)[1][0] == "blocks_0_0" and _stage_nodes(pipe)[2][0] == "blocks_2_1"


@pytest.mark.parametrize("points, message", [
    (["nope", "head"], r"unknown split point 'nope': it names no module called in forward"),
    (["blocks.1", "blocks.1.0"], r"split points 'blocks.1' and 'blocks.1.0' both begin at node "
                                 r"'blocks_1_0', which leaves stage 1 empty"),
    (["head", "blocks.1"], r"split point 'blocks.1' \(node 'blocks_1_0', position 3\) comes before the "
                           r"previous split point 'head' \(node 'head', position 8\); list split points "
                           r"in the order the model runs them"),
    (["stem", "head"], r"split point 'stem' begins at the model's first compute node 'stem', which "
                       r"leaves stage 0 empty"),
    (["x", "head"], r"split point 'x' is a placeholder node, which does no work"),
])
def test_split_point_errors(points, message):
    with pytest.raises(ValueError, match=message):
        fxpipe.compile(Net(), 3, example_inputs=(torch.randn(4, 8),), split_points=points)


def test_split_points_over_the_memory_cap_are_refused():
    with pytest.raises(ValueError, match=r"with these split points stage 0 needs an estimated .* "
                                         r"over max_memory=2000"):
        fxpipe.compile(Net(), 2, example_inputs=(torch.randn(4, 8),), split_points=["head"],
                       max_memory=2000)


class _Encoded(nn.Module):
    """torch.nn's TransformerEncoder, which the fx tracer keeps as one node."""

    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 2, 32, 0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)

    def forward(self, x):
        return self.enc(x)


def test_a_split_inside_or_more_stages_than_a_module_kept_whole_allows_name_it_and_the_way_through():
    # "a module that forward never calls" for enc.layers.2 (it runs, inside enc); "pipeline a larger model"
    x = torch.randn(4, 6, 16)
    with pytest.raises(ValueError, match=r"split point 'enc.layers.2' is inside module 'enc' \(TransformerEncoder\), "
                                         r"which the traced graph calls as one node: split before or after 'enc'.*"
                                         r"tracer='export'"):
        fxpipe.compile(_Encoded(), 2, example_inputs=(x,), split_points=["enc.layers.2"])
    with pytest.raises(ValueError, match=r"n_stages=3 but the model has 1 compute node; .*module 'enc' is called as "
                                         r"one node: trace through it.*tracer='export'"):
        fxpipe.compile(_Encoded(), 3, example_inputs=(x,))


def test_a_forward_computing_nothing_from_its_inputs_is_named_so():
    # "n_stages=2 but the model has 0 compute nodes; use between 1 and 0 stages"
    class Constant(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.unused = torch.nn.Linear(4, 4)

        def forward(self, x):
            return 1.5

    with pytest.raises(ValueError, match="computes nothing from its inputs .*check that forward uses its inputs"):
        fxpipe.compile(Constant(), 2, example_inputs=(torch.randn(2, 4),))
