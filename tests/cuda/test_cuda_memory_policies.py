"""The memory policies on CUDA: offload to pinned host memory on a side stream, selective recomputation."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.testing import assert_pipeline_equivalent

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


class Block(nn.Module):
    def __init__(self, d=256, p=0.0):
        super().__init__()
        self.p = p
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        h = F.dropout(F.gelu(self.up(self.norm(x))), self.p, self.training)
        return x + self.down(h)


def _stack(p=0.0):
    torch.manual_seed(0)
    return nn.Sequential(*[Block(p=p) for _ in range(4)])


def _x():
    return torch.randn(16, 128, 256, device="cuda")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb"])
@pytest.mark.parametrize("checkpoint", ["offload", ["offload", "selective"], "selective"], ids=str)
def test_equal_to_eager_on_cuda(schedule, checkpoint):
    assert_pipeline_equivalent(_stack().cuda(), (_x(),), n_stages=2, chunks=4, checkpoint=checkpoint,
                               devices=["cuda:0"] * 2, schedules=[schedule])


@pytest.mark.parametrize("checkpoint", ["offload", "selective"])
def test_dropout_replayed_at_one_chunk_on_cuda(checkpoint):
    assert_pipeline_equivalent(_stack(p=0.3).cuda(), (_x(),), n_stages=2, chunks=1, checkpoint=checkpoint,
                               devices=["cuda:0"] * 2, schedules=["1f1b"])


def _held_after_forward(checkpoint):
    """Return the device bytes a forward holds for its backward, and the pipe."""
    model = _stack().cuda()
    pipe = fxpipe.compile(model, 2, example_inputs=(_x(),), chunks=2, checkpoint=checkpoint, devices=["cuda:0"] * 2)
    x = _x()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = pipe(x)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    out.float().pow(2).mean().backward()
    return held, pipe


def test_offload_moves_saved_activations_to_pinned_host_memory_on_a_side_stream():
    never, _ = _held_after_forward("never")
    offload, pipe = _held_after_forward("offload")
    assert offload < 0.5 * never, (offload, never)
    saver = pipe._runtime.calls[0].saver
    assert saver.stream != torch.cuda.current_stream()
    model = _stack().cuda()
    pipe = fxpipe.compile(model, 2, example_inputs=(_x(),), chunks=2, checkpoint="offload", devices=["cuda:0"] * 2)
    out = pipe(_x())
    parcels = [ref() for ref in pipe._runtime.calls[0].saver.parcels.values()]
    assert parcels and all(p is not None and p.host and all(h.is_pinned() for h in p.host) for p in parcels)
    out.float().pow(2).mean().backward()


def test_offload_with_a_prefetch_before_each_backward():
    model = _stack().cuda()
    pipe = fxpipe.compile(copy.deepcopy(model), 2, example_inputs=(_x(),), chunks=4, checkpoint="offload",
                          devices=["cuda:0"] * 2, schedule="1f1b")
    fetched = []
    saver = pipe._runtime.calls[0].saver
    prefetch = saver.prefetch
    saver.prefetch = lambda i: (fetched.append(i), prefetch(i))
    pipe.step(_x(), target=_x(), loss_fn=F.mse_loss)
    assert sorted(set(fetched)) == [0, 1, 2, 3]


def test_selective_holds_less_than_never_on_cuda():
    never, _ = _held_after_forward("never")
    selective, _ = _held_after_forward("selective")
    assert selective < 0.8 * never, (selective, never)
