"""torch.as_tensor, asarray and tensor of traced values under fx: recorded as calls (MONAI's HighResNet wraps its output)."""

import copy

import torch
from torch import as_tensor, nn
from torch.nn import functional as F

import fxpipe


class _Wrapped(nn.Module):
    """Wrap a block's output, and the whole forward's, in torch.as_tensor (as MONAI's HighResNet does); divide by a size."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = x + torch.as_tensor(self.a(x)) + torch.asarray(x) / torch.tensor(x.shape[1])
        return as_tensor(self.b(torch.relu(h)), dtype=torch.float64)  # imported by name from torch


def test_as_tensor_of_a_traced_value_traces_and_trains_as_eager():
    # torch.fx failed with "__cuda_array_interface__ must be a dict" and a hint to make the block a leaf, after which
    # the top-level forward's own as_tensor failed the same way
    torch.manual_seed(0)
    model, x, y = _Wrapped(), torch.randn(4, 8), torch.randn(4, 8, dtype=torch.float64)
    eager = copy.deepcopy(model)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=2, devices=["cpu"] * 2)
    loss = pipe.step(x, target=y, loss_fn=F.mse_loss)
    expected = F.mse_loss(eager(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    assert torch.as_tensor([1, 2]).tolist() == [1, 2]  # torch's own again after the trace
