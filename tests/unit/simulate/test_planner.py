"""The planner: every configuration simulated, ranked by throughput, the memory budget enforced."""

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.simulate.planner import search


def _model():
    return nn.Sequential(*[nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 128)) for _ in range(4)])


def test_candidates_are_ranked_by_predicted_throughput():
    found = search(_model(), (torch.randn(64, 128),), ranks=4, device="h100", chunks=[1, 4, 16])
    speeds = [c.sim.throughput for c in found.ranked]
    assert speeds == sorted(speeds, reverse=True)
    assert {c.stages for c in found.ranked} == {1, 2, 4}  # the divisors of the ranks
    assert {c.schedule for c in found.ranked} == {"gpipe", "1f1b", "zb"}
    assert not any(c.chunks == 1 and c.checkpoint == "except_last" for c in found.ranked)  # same as never
    assert found.best is found.ranked[0] and not found.rejected


def test_configurations_over_the_budget_are_rejected():
    kw = dict(ranks=2, device="h100", chunks=[1, 8], optimizer="adam")
    everything = search(_model(), (torch.randn(64, 128),), **kw)
    peaks = sorted({max(c.peaks) for c in everything.ranked})
    budget = peaks[len(peaks) // 2]
    found = search(_model(), (torch.randn(64, 128),), memory=budget, **kw)
    assert found.rejected and found.ranked
    assert all(max(c.peaks) > budget for c in found.rejected)
    assert all(max(c.peaks) <= budget for c in found.ranked)
    # the one-stage, no-checkpointing step holds the most: it does not fit
    assert not any(c.stages == 1 and c.checkpoint == "never" for c in found.ranked)


def test_the_chosen_plan_compiles(tmp_path):
    model, x = _model(), torch.randn(64, 128)
    found = search(model, (x,), ranks=2, device="a100", chunks=[2, 4], stages=[2])
    best = found.best
    found.plan(best).save(str(tmp_path / "best.json"))
    plan = fxpipe.PipelinePlan.load(str(tmp_path / "best.json"))
    assert (plan.n_stages, plan.chunks, plan.schedule, plan.checkpoint) == (2, best.chunks, best.schedule,
                                                                            best.checkpoint)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), plan=str(tmp_path / "best.json"), chunks=plan.chunks,
                          schedule=plan.schedule, checkpoint=plan.checkpoint, devices=["cpu", "cpu"])
    assert [s.nodes for s in pipe.plan.stages] == [s.nodes for s in plan.stages]
    pipe.step(x, target=torch.randn(64, 128), loss_fn=torch.nn.functional.mse_loss)


def test_measured_costs_on_this_machine():
    found = search(_model(), (torch.randn(16, 128),), ranks=2, device="cpu", chunks=[2], stages=[2],
                   schedules=["1f1b"], checkpoints=["never"], measure=True)
    (c,) = found.ranked
    assert c.sim.step_time > 0 and c.sim.costs[0].forward > 0


@pytest.mark.parametrize("kw", [{"device": "tpu"}])
def test_unknown_device_is_refused(kw):
    with pytest.raises(ValueError, match="use one of"):
        search(_model(), (torch.randn(8, 128),), ranks=2, **kw)


def test_selective_and_a_policy_per_stage_are_searched():
    kw = dict(ranks=2, device="h100", chunks=[8], stages=[2], schedules=["1f1b"], optimizer="none")
    model, x = _model(), (torch.randn(256, 128),)
    everything = search(model, x, **kw)
    assert {c.checkpoint for c in everything.ranked} >= {"never", "selective", "except_last", "always"}
    peaks = {c.checkpoint: c.peaks for c in everything.ranked}
    budget = (max(peaks["never"]) + max(peaks["always"])) / 2
    found = search(model, x, memory=budget, **kw)
    auto = [c for c in found.ranked + found.rejected if c.checkpoint == "auto"]
    for c in auto:  # searched only when it mixes modes; what compile takes for it is the list
        assert len(set(c.policies)) > 1 and c.setting == c.policies
    assert all(max(c.peaks) <= budget for c in found.ranked)
    plan = found.plan(found.best)
    assert plan.policies() == found.best.policies and all(s.peak for s in plan.stages)


class _Block(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x))))


class _Decoder(nn.Module):
    def __init__(self, vocab=64, d=32, n=4, seq=8):
        super().__init__()
        self.embed, self.blocks, self.head = nn.Embedding(vocab, d), nn.Sequential(*[_Block(d) for _ in range(n)]), \
            nn.Linear(d, vocab)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)

    def forward(self, ids):
        return self.head(self.blocks(self.embed(ids) + self.pos[: ids.shape[1]]))


def test_a_gpu_plan_weighs_a_crossing_byte_by_the_device_model_s_link():
    # h100 cut a small decoder as [the ids alone | everything]: a byte weighed PCIe's 2000 FLOPs, not NVLink's 149
    torch.manual_seed(0)
    found = search(_Decoder(), (torch.randint(0, 64, (8, 8)),), ranks=2, device="h100", chunks=[1], stages=[2],
                   schedules=["gpipe"], checkpoints=["never"])
    flops = [s.flops for s in found.plan(found.best).stages]
    assert min(flops) > 0.4 * sum(flops), flops
