"""The plan: a printable table, a JSON round trip, consistent producers and consumers."""

import pytest
import torch
from unet import UNet

import fxpipe
from fxpipe import passes
from fxpipe.plan.pipeline import PipelinePlan


def _plan():
    model = UNet(depth=3, base=4).eval()
    pipe = fxpipe.compile(model, 4, example_inputs=(torch.randn(4, 3, 16, 16),), chunks=4, devices=["cpu"] * 4)
    return pipe.plan


def test_table_shows_every_stage_and_route():
    plan = _plan()
    text = str(plan)
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["stage", "device", "nodes"]
    body = [l for l in lines[2:2 + plan.n_stages]]
    assert [int(l.split()[0]) for l in body] == list(range(plan.n_stages))
    assert "bottleneck" in text and "efficiency at chunks=4" in text
    for r in plan.skips:
        assert f"{r.name}: stage {r.src} -> stage {r.dst}" in text


def test_table_names_what_each_stage_computes_first_not_the_state_it_reads():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.1), torch.nn.Linear(8, 8),
                                torch.nn.ReLU(), torch.nn.Linear(8, 8))
    pipe = fxpipe.compile(model, 3, example_inputs=(torch.randn(4, 8),), devices=["cpu"] * 3, tracer="export")
    firsts = [line.split()[3] for line in str(pipe.plan).splitlines()[2:5]]
    ops = dict(zip(pipe.plan.graph_nodes, pipe.plan.graph_ops))
    assert all(ops[name] not in ("get_attr", "placeholder") for name in firsts), firsts  # not "training", "p_0_weight"


class _Positions(torch.nn.Module):
    """Read the sequence length twice in a later stage: torch.export routes its symbolic size there."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.pos = torch.nn.Parameter(torch.randn(1, 16, 8))

    def forward(self, x):
        h = self.b(torch.relu(self.a(x)))
        return self.c(h + self.pos[:, :x.shape[1]])


def test_the_exported_tables_name_no_bookkeeping_and_fold_symbolic_sizes():
    # the first column read "_guards_fn" or "_assert_tensor_metada...", and every sym_size was a 0B skip route
    pipe = fxpipe.compile(_Positions(), 3, example_inputs=(torch.randn(2, 6, 8),), devices=["cpu"] * 3,
                          tracer="export")
    text = str(pipe.plan)
    firsts = [line.split()[3] for line in text.splitlines()[2:5]]
    assert not any(f.startswith(("_guards", "_assert", "sym_size")) for f in firsts), firsts
    assert "sym_size" not in text.split("skip routes:")[-1].split("symbolic size")[0], text


def test_json_round_trip(tmp_path):
    plan = _plan()
    again = PipelinePlan.from_json(plan.to_json())
    assert again == plan
    path = tmp_path / "plan.json"
    plan.save(str(path))
    assert PipelinePlan.load(str(path)) == plan


def test_every_node_in_one_stage_and_values_flow_forward():
    plan = _plan()
    held = [n for s in plan.stages for n in s.nodes]
    compute_and_io = [n for n in plan.graph_nodes]
    assert set(held) == set(compute_and_io)
    producer = plan.producer()
    for s in plan.stages[1:]:
        for v in s.inputs:
            assert producer[v] < s.index


def test_from_dict_refuses_other_data():
    import pytest
    with pytest.raises(ValueError, match="not an fxpipe plan"):
        PipelinePlan.from_dict({"stages": []})


def test_report_columns_and_summary():
    plan = _plan()
    header = str(plan).splitlines()[0].split()
    for column in ("FLOPs", "params", "kept", "ckpt", "memory"):
        assert column in header
    assert "ms" not in header  # not profiled
    flops = [s.flops for s in plan.stages]
    mean = sum(flops) / len(flops)
    assert plan.bottleneck() == max(flops) / mean
    m, n = plan.chunks, plan.n_stages
    assert abs(plan.efficiency() - m / (m + n - 1) * mean / max(flops)) < 1e-12
    assert f"bottleneck (max/mean FLOPs f+b): {plan.bottleneck():.3f}" in str(plan)


def test_stage_costs_add_up_to_the_graph():
    model = UNet(depth=3, base=4).eval()
    x = torch.randn(4, 3, 16, 16)
    pipe = fxpipe.compile(model, 3, example_inputs=(x,), chunks=2, devices=["cpu"] * 3)
    gm = passes.annotate(fxpipe.trace(UNet(depth=3, base=4).eval()), (x,))
    total = sum(n.meta["fxpipe.flops"] + n.meta["fxpipe.flops_bwd"] for n in gm.graph.nodes)
    assert sum(s.flops for s in pipe.plan.stages) == total
    for s in pipe.plan.stages:
        saved = sum(n.meta["fxpipe.saved_bytes"] for n in gm.graph.nodes if n.name in s.nodes)
        assert s.saved_bytes == saved // 2
        received = sum(n.meta["fxpipe.bytes"] for n in gm.graph.nodes if n.name in s.inputs)
        assert s.checkpoint_bytes == received // 2
        f_act, f_in = passes.memory_factors("except_last", 2)
        # the estimate bounds what the stage holds: its own parameters (and the gradients of the trainable ones,
        # not of buffers) and actual inputs
        grads = sum(n.meta["fxpipe.grad_bytes"] for n in gm.graph.nodes if n.name in s.nodes)
        assert s.memory >= int(s.params + grads + f_act * saved + f_in * received)


def test_old_plans_without_cost_fields_still_load():
    plan = _plan()
    data = plan.to_dict()
    for s in data["stages"]:
        for key in ("saved_bytes", "checkpoint_bytes", "memory", "cost"):
            del s[key]
    again = PipelinePlan.from_dict(data)
    assert again.stages[0].memory == 0 and again.stages[0].nodes == plan.stages[0].nodes


def _frozen_front(checkpoint: str, tracer: str = "fx") -> fxpipe.Pipe:
    """Compile a frozen two-layer encoder before a trainable head (PEFT's layout) in three stages."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU()) for _ in range(3)],
                                torch.nn.Linear(32, 4))
    model[:2].requires_grad_(False)
    return fxpipe.compile(model, 3, example_inputs=(torch.randn(8, 32),), chunks=4, checkpoint=checkpoint,
                          devices=["cpu"] * 3, tracer=tracer)


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_frozen_stage_is_shown_and_simulated_as_the_runtime_runs_it(tracer):
    """A stage nothing in which needs a gradient keeps nothing and is not recomputed, whatever the mode."""
    # under export the first stage holds export's _guards_fn call, with no value: the stage was not seen frozen
    pipe = _frozen_front("always", tracer)
    first, second = pipe.plan.stages[:2]
    assert first.frozen and not second.frozen
    assert first.saved_bytes == first.checkpoint_bytes == 0 and second.saved_bytes > 0
    assert "frozen" in pipe.plan.table().splitlines()[2]
    sim = fxpipe.simulate(pipe, device="h100")
    assert sim.policies[:2] == ["never", "always"]
    never = fxpipe.simulate(_frozen_front("never", tracer), device="h100")
    assert sim.stages[0].busy == pytest.approx(never.stages[0].busy)  # no forward again in its backward
    assert sim.stages[0].memory.activations == never.stages[0].memory.activations


def test_the_memory_of_a_cut_counts_no_gradient_for_frozen_parameters():
    # every parameter was counted twice (weight and gradient): a frozen base that fits was refused by max_memory=
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)], torch.nn.Linear(256, 4))
    model[:4].requires_grad_(False)
    pipe = fxpipe.compile(model, 2, example_inputs=(torch.randn(8, 256),), chunks=2, devices=["cpu"] * 2)
    for stage in pipe.plan.stages:
        assert stage.memory < 1.2 * stage.params, (stage.memory, stage.params)
