import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.passes.selective import selective_plan
from fxpipe.runtime.stage.keepstate import written_buffers
from torch.nn.utils.parametrizations import spectral_norm


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8),
                         nn.Flatten(), nn.Linear(8 * 4 * 4, 10)).train()


@pytest.mark.parametrize("tracer", ["fx", "export"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb"])
@pytest.mark.parametrize("checkpoint", ["except_last", "always", "selective"])
def test_recomputation_leaves_running_statistics_as_eager_on_the_micro_batches(tracer, schedule, checkpoint):
    # a whole-stage recomputation ran the batch norms' forward once more in training mode:
    # running mean and variance moved twice and num_batches_tracked counted 3 or 4 for 2 micro-batches
    model = _model()
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))
    eager = copy.deepcopy(model)
    for xi, yi in zip(x.chunk(2), y.chunk(2)):
        (F.cross_entropy(eager(xi), yi) / 2).backward()
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=2, schedule=schedule, checkpoint=checkpoint,
                          tracer=tracer)
    pipe.step(x, target=y, loss_fn=F.cross_entropy)
    for (name, got), (_, want) in zip(model.named_buffers(), eager.named_buffers()):
        torch.testing.assert_close(got, want, msg=name)
    for (name, got), (_, want) in zip(model.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(got.grad, want.grad, msg=name)


def test_the_buffers_a_forward_writes_are_found_in_both_front_ends():
    x = torch.randn(4, 3, 8, 8)
    for tracer in ("fx", "export"):
        pipe = fxpipe.compile(_model(), 2, example_inputs=(x,), tracer=tracer)
        found = [name for gm in pipe.stages for name in written_buffers(gm)]
        assert sorted(found) == sorted(f"{k}.{b}" for k in ("1", "4")
                                       for b in ("running_mean", "running_var", "num_batches_tracked")), (tracer, found)


def _spectral():
    torch.manual_seed(0)
    return nn.Sequential(spectral_norm(nn.Linear(8, 16)), nn.Tanh(), spectral_norm(nn.Linear(16, 16)), nn.Tanh(),
                         spectral_norm(nn.Linear(16, 4)))


@pytest.mark.parametrize("tracer", ["fx", "export"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb"])
@pytest.mark.parametrize("checkpoint", ["except_last", "always", "selective"])
def test_a_recomputation_starts_from_the_buffers_its_forward_read(tracer, schedule, checkpoint):
    # a spectral norm's power iteration writes its u and v in forward, and the weight is built from
    # them: recomputed from the values later micro-batches left, gradients were 5e-3 off eager's
    model = _spectral()
    eager = copy.deepcopy(model)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    pipe = fxpipe.compile(model, 3, example_inputs=(x,), chunks=2, schedule=schedule, checkpoint=checkpoint,
                          tracer=tracer)
    for _ in range(2):  # the second step: buffers found by the first forward
        for p in [*model.parameters(), *eager.parameters()]:
            p.grad = None
        loss = pipe.step(x, target=y, loss_fn=F.mse_loss)
        expected = sum(F.mse_loss(eager(xi), yi) / 2 for xi, yi in zip(x.chunk(2), y.chunk(2)))
        expected.backward()
        torch.testing.assert_close(loss, expected.detach())
        for (name, got), (_, want) in zip(model.named_parameters(), eager.named_parameters()):
            torch.testing.assert_close(got.grad, want.grad, msg=name)
        for (name, got), (_, want) in zip(model.named_buffers(), eager.named_buffers()):
            torch.testing.assert_close(got, want, msg=name)


def test_selective_recomputation_keeps_what_reads_a_buffer_written_in_place():
    pipe = fxpipe.compile(_spectral(), 1, example_inputs=(torch.randn(8, 8),), tracer="export")
    gm = pipe.stages[0]
    plan = selective_plan(gm)
    readers = [n.name for n in gm.graph.nodes if n.op == "call_function"
               and any(a.op == "get_attr" and a.target.endswith(("_u", "_v")) for a in n.all_input_nodes)]
    assert readers and all(plan.saved[plan.names.index(name)] for name in readers)
