"""A parameter only outputs the loss ignores depend on keeps no gradient, as in eager, under every schedule."""

from __future__ import annotations

import copy

import pytest
import torch
from unreached_cases import SPLITS, AuxInTraining, Headed, Sided, logits_only, main_only

import fxpipe
from fxpipe import passes
from fxpipe.plan.assign import annotate_graph


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb", "interleaved", "zbv"])
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_a_parameter_only_an_ignored_output_reads_keeps_none(schedule, checkpoint):
    # before: 'scale', read in stage 0 by an output the loss ignores, got a zero gradient through the skip
    # to stage 2, which AdamW's weight decay then applied (eager leaves it None and the weight alone)
    model = Sided()
    eager = copy.deepcopy(model)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    n = 4 if schedule in ("interleaved", "zbv") else 3
    pipe = fxpipe.compile(model, n, example_inputs=(x,), devices=["cpu"] * n, chunks=2, schedule=schedule,
                          checkpoint=checkpoint, split_points=SPLITS[n],
                          stages_per_rank=2 if n == 4 else 1)
    pipe.step(x, target=y, loss_fn=main_only)
    main_only(eager(x), y).backward()
    assert model.scale.grad is None and model.tail.grad is None
    _assert_grads_like(model, eager)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    opt.step()
    assert model.scale.item() == 2.0


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("checkpoint", ["except_last", "always", "never"])
def test_a_head_whose_value_is_a_stage_s_first_ignored_output_keeps_none(schedule, checkpoint):
    # before: under gpipe with recomputation the phony join on the stage's first output (the ignored head's)
    # handed zeros back, so 'ha' (BertForPreTraining's other head, CLIP's logit_scale) got a zero gradient
    model = Headed()
    eager = copy.deepcopy(model)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), devices=["cpu"] * 2, chunks=2, schedule=schedule,
                          checkpoint=checkpoint, split_points=["l2"])
    pipe.step(x, target=y, loss_fn=main_only)
    main_only(eager(x), y).backward()
    assert model.ha.weight.grad is None and model.ha.bias.grad is None
    _assert_grads_like(model, eager)


def test_the_plan_names_what_may_get_no_gradient():
    x = torch.randn(8, 8)
    pipe = fxpipe.compile(Sided(), 3, example_inputs=(x,), devices=["cpu"] * 3, split_points=SPLITS[3])
    stages = pipe.plan.stages
    assert stages[0].maybe_unused == ["scale"] and stages[2].maybe_unused == ["tail"]
    assert stages[2].maybe_no_grad == [v for v in stages[2].grad_inputs if v != "b"] != []
    assert stages[1].maybe_no_grad == [] and stages[1].maybe_unused == []


def test_a_model_with_one_output_names_nothing():
    x = torch.randn(2, 4)
    gm = fxpipe.trace(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4)))
    annotate_graph(gm, (x,), {})
    assert passes.maybe_without_grad(gm) == set()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb"])
def test_a_namedtuple_returned_in_training_only_names_its_auxiliary_head(schedule):
    # the namedtuple chosen by the mode was one output node: nothing was named, so DDP wrapped the aux head
    model = AuxInTraining()
    eager = copy.deepcopy(model)
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), devices=["cpu"] * 2, chunks=2, schedule=schedule,
                          split_points=["c"])
    assert pipe.plan.stages[1].maybe_unused == ["aux", "head"]
    pipe.step(x, target=y, loss_fn=logits_only)
    logits_only(eager(x), y).backward()
    assert model.aux.weight.grad is None and model.aux.bias.grad is None
    _assert_grads_like(model, eager)


def _assert_grads_like(model, eager):
    """Assert every gradient eager made equals the pipe's (the pipe's None where eager's is, checked apart)."""
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        if q.grad is not None:
            assert torch.allclose(p.grad, q.grad, atol=1e-6), name
