"""torch.as_tensor, asarray and tensor of traced values under fx: recorded as calls (MONAI's HighResNet wraps its output)."""

import copy

import pytest
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
    # the pipe's code registered wrap("torch.as_tensor"), and every later trace failed: KeyError 'torch.as_tensor'
    fxpipe.compile(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), 2, example_inputs=(x,), devices=["cpu"] * 2)


class _Listed(nn.Module):
    """Make a tensor of a list of traced values (read as the call is made: fx cannot record it)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        return h * torch.tensor([h.mean(), h.std()]).sum()


def test_a_list_of_traced_values_is_left_to_torch_and_a_name_imported_elsewhere_is_named():
    # recorded, the list failed later on data-less tensors with a hint that a branch was dropped
    with pytest.raises(fxpipe.TraceError, match="cannot trace _Listed"):
        fxpipe.compile(_Listed(), 2, example_inputs=(torch.randn(4, 8),), devices=["cpu"] * 2)
    from fxpipe.frontend.tracing import _explain, _Tracer

    # a traced value given to as_tensor imported into a helper's module (not recorded) fails so
    error = _explain(_Listed(), _Tracer((), frozenset()), TypeError("`__cuda_array_interface__` must be a dict"))
    assert "by a name imported from torch into a helper's module" in str(error) and "tracer='export'" in str(error)
