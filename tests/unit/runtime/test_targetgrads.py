"""A target that requires grad: the step's loss backpropagates into its graph as eager's does."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe


def _kd(student_out, teacher_out):
    return F.kl_div(torch.log_softmax(student_out, -1), torch.softmax(teacher_out, -1), reduction="batchmean")


@pytest.mark.parametrize("schedule, stages_per_rank", [("gpipe", 1), ("1f1b", 1), ("zb", 1), ("interleaved", 2),
                                                      ("zbv", 2)])
def test_a_teacher_computed_with_grad_gets_the_gradient_eager_gives_it(schedule, stages_per_rank):
    # the target's rows were views into the teacher's graph: the first micro-batch's backward freed it
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10))
    student = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))
    teacher_e, student_e = copy.deepcopy(teacher), copy.deepcopy(student)
    x = torch.randn(8, 16)
    _kd(student_e(x), teacher_e(x)).backward()
    n = 2 * stages_per_rank
    pipe = fxpipe.compile(student, n, example_inputs=(x,), chunks=4, schedule=schedule, devices=["cpu"] * n,
                          stages_per_rank=stages_per_rank,
                          split_points=["1", "2", "3"][: n - 1] if n > 2 else None)
    pipe.step(x, target=teacher(x), loss_fn=_kd)
    for mine, theirs in [(student, student_e), (teacher, teacher_e)]:
        for (name, p), q in zip(mine.named_parameters(), theirs.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_a_target_requiring_grad_in_a_structure_and_a_second_step():
    # a dict target, one value requiring grad: only that one is given a gradient; the next step again
    torch.manual_seed(0)
    model, scale = nn.Linear(4, 3), nn.Parameter(torch.tensor(2.0))
    eager, scale_e = copy.deepcopy(model), copy.deepcopy(scale)
    x, y = torch.randn(6, 4), torch.randn(6, 3)

    def loss_fn(out, t):
        return F.mse_loss(out, t["y"] * t["s"]) + t["w"].float().mean() * 0

    pipe = fxpipe.compile(model, 1, example_inputs=(x,), chunks=3, schedule="1f1b")
    for _ in range(2):
        loss_fn(eager(x), {"y": y, "s": scale_e.expand(6, 1), "w": torch.ones(6)}).backward()
        pipe.step(x, target={"y": y, "s": scale.expand(6, 1), "w": torch.ones(6)}, loss_fn=loss_fn)
    torch.testing.assert_close(scale.grad, scale_e.grad)
    torch.testing.assert_close(model.weight.grad, eager.weight.grad)


@pytest.mark.parametrize("schedule, stages_per_rank", [("gpipe", 1), ("1f1b", 1), ("zb", 1), ("zbv", 2)])
def test_an_input_and_a_target_sharing_the_users_graph_backpropagate_in_one_backward(schedule, stages_per_rank):
    # h = enc(x); pipe.step(h, target=head(h)): the target's backward came after the input's had freed the graph
    # ("backward through the graph a second time"), under gpipe too since the target is read through leaves
    torch.manual_seed(0)
    enc, head = nn.Linear(6, 8), nn.Linear(8, 4)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    enc_e, head_e, model_e = copy.deepcopy(enc), copy.deepcopy(head), copy.deepcopy(model)
    x = torch.randn(8, 6)
    h_e = enc_e(x)
    F.mse_loss(model_e(h_e), head_e(h_e)).backward()
    n = 2 * stages_per_rank
    h = enc(x)
    pipe = fxpipe.compile(model, n, example_inputs=(h.detach().requires_grad_(),), chunks=4, schedule=schedule,
                          devices=["cpu"] * n, stages_per_rank=stages_per_rank, split_points=["1", "2", "3"][: n - 1])
    pipe.step(h, target=head(h), loss_fn=F.mse_loss)
    for mine, theirs in [(enc, enc_e), (head, head_e), (model, model_e)]:
        for (name, p), q in zip(mine.named_parameters(), theirs.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
