import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.runtime.stage.keepstate import written_buffers


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8),
                         nn.Flatten(), nn.Linear(8 * 4 * 4, 10)).train()


@pytest.mark.parametrize("tracer", ["fx", "export"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb"])
@pytest.mark.parametrize("checkpoint", ["except_last", "always"])
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
