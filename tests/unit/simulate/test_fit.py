"""checkpoint="auto": the least recomputation per stage that fits, the cut chosen with it, the refusal."""

import copy

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.errors import MemoryBudgetError
from fxpipe.options import POLICIES, CompileOptions
from fxpipe.plan.assign import assign_stages
from fxpipe.plan.pipeline import PipelinePlan
from fxpipe.plan.stages import make_plan
from fxpipe.runtime.schedules.builtin import resolve
from fxpipe.simulate.devices import device_model
from fxpipe.simulate.fit import choose, fit
from fxpipe.simulate.stagecost import graph_costs
from fxpipe.testing import assert_pipeline_equivalent

MODEL = device_model("h100")


class Block(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def _stack(blocks=8):
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(blocks)])


def _front(n, chunks=8, schedule="1f1b", rows=16, blocks=8, **kw):
    """Trace, annotate and cut the stack as compile does; return the assignment, options and schedule."""
    options = CompileOptions(n, example_inputs=(torch.randn(rows, 8, 32),), chunks=chunks, schedule=schedule, **kw)
    devices = [torch.device("cpu")] * n
    front = assign_stages(_stack(blocks), options, None, devices, devices[0])
    return front, options, resolve(schedule, n, chunks), devices


def _costs(front, options, schedule, devices, rows=16):
    plan = make_plan(front, options, devices, schedule.name, schedule.ranks, None)[0]
    return graph_costs(front.gm, plan, MODEL, rows / front.micro)


def _step(costs, policies, actions, ranks):
    from fxpipe.simulate.simulation import run

    return run(costs, actions, ranks, ranks, MODEL, name="1f1b", checkpoint=policies, runtime="distributed", batch=16)


def test_the_first_stage_of_1f1b_gets_more_recomputation_than_the_last():
    front, options, schedule, devices = _front(4, checkpoint="never")
    costs, actions, ranks = _costs(front, options, schedule, devices), schedule.actions(8), [0, 1, 2, 3]
    never = _step(costs, ["never"] * 4, actions, ranks)
    always = _step(costs, ["always"] * 4, actions, ranks)
    budget = (max(m.peak for m in never.devices.values()) + max(m.peak for m in always.devices.values())) / 2
    policies, sim, fits = choose(costs, actions, ranks, ranks, MODEL, budget, name="1f1b", runtime="distributed",
                                 batch=16)
    assert fits and all(m.peak <= budget for m in sim.devices.values())
    order = [POLICIES.index(p) for p in policies]
    assert order[0] > order[-1] and order == sorted(order, reverse=True), policies
    for j, p in enumerate(policies):  # the least recomputation that fits: one step less overflows
        if p != "never":
            less = policies[:j] + [POLICIES[POLICIES.index(p) - 1]] + policies[j + 1:]
            assert _step(costs, less, actions, ranks).devices[j].peak > budget


def test_auto_equal_to_eager_and_its_plan_records_policy_and_peak(tmp_path):
    x = torch.randn(16, 8, 32)
    never = fxpipe.simulate(fxpipe.compile(_stack(), 2, example_inputs=(x,), chunks=4, checkpoint="never",
                                           devices=["cpu"] * 2), device="h100")
    budget = 0.8 * never.devices[0].peak  # one CPU: the stages share the device and its budget
    pipe = assert_pipeline_equivalent(_stack(), (x,), n_stages=2, chunks=4, checkpoint="auto", max_memory=budget,
                                      devices=["cpu"] * 2, schedules=["1f1b"])
    assert pipe.plan.checkpoint == "auto" and "never" not in pipe.plan.policies()
    assert all(s.peak > 0 for s in pipe.plan.stages)
    table = pipe.plan.table()
    assert "checkpoint" in table and "peak" in table and pipe.plan.policies()[0] in table
    path = tmp_path / "plan.json"
    pipe.plan.save(str(path))
    again = PipelinePlan.load(str(path))
    assert again.policies() == pipe.plan.policies() and [s.peak for s in again.stages] == [s.peak for s in pipe.plan.stages]


def test_a_plan_saved_before_policies_per_stage_loads_with_the_plans_mode():
    plan = fxpipe.compile(_stack(2), 2, example_inputs=(torch.randn(4, 8, 32),), checkpoint="always",
                          devices=["cpu"] * 2).plan
    data = plan.to_dict()
    for s in data["stages"]:
        del s["checkpoint"], s["peak"]
    old = PipelinePlan.from_dict(data)
    assert old.policies() == ["always", "always"]


def test_nothing_fits_says_which_stage_overflows_by_how_much_and_what_would_fit():
    with pytest.raises(MemoryBudgetError) as info:
        fxpipe.compile(_stack(), 2, example_inputs=(torch.randn(16, 8, 32),), chunks=2, checkpoint="auto",
                       max_memory=200e3, devices=["cpu"] * 2, schedule="1f1b")
    message = str(info.value)
    assert "stage 0 under" in message and "stage 1 under" in message and "over by" in message
    assert "chunks=4" in message and "3 stages on 3 ranks (runtime='distributed')" in message
    assert "raise max_memory" in message
    # both still over: they were listed under "what would fit"
    assert "nothing tried fits: chunks=4 (still over" in message and "what would fit" not in message
    fits = r"what would fit: chunks=4 \(fits: .*3 stages on 3 ranks \(runtime='distributed'\) \(fits"
    with pytest.raises(MemoryBudgetError, match=fits):
        fxpipe.compile(_stack(), 2, example_inputs=(torch.randn(16, 8, 32),), chunks=2, checkpoint="auto",
                       max_memory=800e3, devices=["cpu"] * 2, schedule="1f1b")


def test_auto_needs_a_budget_and_example_inputs():
    with pytest.raises(ValueError, match="max_memory"):
        fxpipe.compile(_stack(2), 2, example_inputs=(torch.randn(4, 8, 32),), checkpoint="auto")
    with pytest.raises(ValueError, match="example_inputs"):
        fxpipe.compile(_stack(2), 2, checkpoint="auto", max_memory=1e9)


def test_the_cut_is_chosen_with_the_policies():
    # rank 0 of 1F1B holds two micro-batches, rank 1 one: with a block moved to rank 1 less recomputation
    # fits, and the predicted step is faster; the budgets are swept for one where that decides
    from fxpipe.passes.shift import neighbours, recut

    front, options, schedule, devices = _front(2, checkpoint="auto", max_memory=1.0, rows=32, blocks=16)
    cuts = [list(front.cut.starts), *neighbours(front.gm, front.cut)]
    assert len(cuts) == 3

    def tried(starts, budget):
        probe = copy.copy(front)
        probe.cut = recut(front.gm, front.cut, starts, micro_batches=front.micro)
        return choose(_costs(probe, options, schedule, devices, 32), schedule.actions(8), [0, 1], [0, 1], MODEL,
                      budget, name="1f1b", runtime="distributed", batch=32)

    never = max(m.peak for m in tried(cuts[0], float("inf"))[1].devices.values())
    for k in range(1, 25):
        budget = never * (1 - k / 50)
        results = [tried(c, budget) for c in cuts]
        fitting = [(r[1].step_time, j) for j, r in enumerate(results) if r[2]]
        if fitting and min(fitting)[1] != 0 and (not results[0][2] or min(fitting)[0] * 1.01 < results[0][1].step_time):
            break
    else:
        pytest.fail("no budget at which a moved cut fits better")
    options.max_memory = budget
    chosen = fit(front, options, devices, schedule, distributed=True)
    assert chosen.fits and chosen.cut.starts == cuts[min(fitting)[1]]
    assert chosen.policies == results[min(fitting)[1]][0]
    stages = [n.meta["fxpipe.stage"] for n in front.cut.order]  # the graph carries the chosen cut
    assert stages.index(1) == chosen.cut.starts[1]


@pytest.mark.parametrize("shard", [False, True])
def test_data_parallel_state_is_the_planners(shard):
    # FSDP2 as the runtime runs it holds the gathered parameters and full gradients for the step
    # beside their 1/dp shards: sharding must not make "auto" think a stage got lighter
    fits = {}
    for dp in (1, 2):
        front, options, schedule, devices = _front(2, checkpoint="auto", max_memory=1e12, runtime="distributed",
                                                   data_parallel=dp, data_parallel_shard=shard and dp > 1)
        fits[dp] = fit(front, options, devices, schedule, distributed=True)
    one, two = (max(f.sim.devices.values(), key=lambda m: m.params) for f in (fits[1], fits[2]))
    assert two.params == pytest.approx(one.params * (1.5 if shard else 1.0))
    assert two.grads == pytest.approx(one.grads)
