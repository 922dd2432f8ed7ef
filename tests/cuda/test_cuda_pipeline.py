"""Pipelines on CUDA equal eager: several stages on one GPU, stages alternating between a GPU
and the CPU (every boundary a copy), every schedule, a tuple input read two stages later;
with two GPUs, a worker thread per GPU. (Waits: test_cuda_waits; random numbers: test_cuda_rng.)
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from models import FACTORIES, TiedTransformer
from torch import nn
from unet import UNet

import fxpipe
from fxpipe.testing import assert_pipeline_equivalent, max_relative_error

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ONE_GPU = ["cuda:0"] * 4
MIXED = ["cuda:0", "cpu", "cuda:0", "cpu"]
DEVICES = {"one_gpu": ONE_GPU, "mixed": MIXED}


@pytest.mark.parametrize("checkpoint", ["except_last", "never"])
@pytest.mark.parametrize("devices", sorted(DEVICES))
@pytest.mark.parametrize("name", ["mlp", "unet", "transformer", "multi_io"])
def test_equal_to_eager(name, devices, checkpoint):
    model, args, kwargs = FACTORIES[name]()
    pipe = assert_pipeline_equivalent(model, args, example_kwargs=kwargs, n_stages=4, chunks=3,
                                      checkpoint=checkpoint, devices=DEVICES[devices])
    assert [str(d) for d in pipe.devices] == DEVICES[devices]


def _step_errors(model, x, target, loss_fn, **kw):
    """Run eager and ``pipe.step`` on copies of ``model``; return the loss and worst gradient errors."""
    eager = copy.deepcopy(model)
    expected = loss_fn(eager(x), target)
    expected.backward()
    pipe = fxpipe.compile(model, example_inputs=(x,), **kw)
    loss = pipe.step(x, target=target, loss_fn=loss_fn)
    grads = dict(eager.named_parameters())
    worst = max((max_relative_error(p.grad, grads[name].grad), name) for name, p in model.named_parameters())
    return max_relative_error(loss, expected), worst


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb"])
@pytest.mark.parametrize("devices", sorted(DEVICES))
def test_step_every_schedule_tied_transformer(schedule, devices):
    tokens, target = torch.randint(0, 32, (8, 8)), torch.randint(0, 32, (8, 8))

    def loss_fn(logits, tgt):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tgt.reshape(-1).to(logits.device))

    loss_error, (grad_error, name) = _step_errors(TiedTransformer(), tokens, target, loss_fn, n_stages=4,
                                                  chunks=4, schedule=schedule, devices=DEVICES[devices])
    assert loss_error < 1e-5 and grad_error < 1e-5, (loss_error, grad_error, name)


@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_step_unet_skips_across_devices(schedule):
    x, target = torch.randn(6, 3, 16, 16), torch.randn(6, 2, 16, 16)
    loss_error, (grad_error, name) = _step_errors(UNet(depth=2, base=4).eval(), x, target, F.mse_loss,
                                                  n_stages=4, chunks=3, schedule=schedule,
                                                  devices=MIXED, checkpoint="always")
    assert loss_error < 1e-5 and grad_error < 1e-5, (loss_error, grad_error, name)


class PairNet(nn.Module):
    """Read a tuple input in the first stage and again in the last."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, pair):
        x, _ = pair
        return self.c(self.b(torch.relu(self.a(x)))) * pair[1]


@pytest.mark.parametrize("devices", [["cuda:0", "cpu", "cpu"], ["cpu", "cuda:0", "cuda:0"]])
def test_a_tuple_value_crosses_devices(devices):
    pair = (torch.randn(6, 8), torch.randn(6, 8))
    pipe = assert_pipeline_equivalent(PairNet(), (pair,), n_stages=3, chunks=2, devices=devices,
                                      split_points=["b", "c"])
    assert ("pair", 0, 2) in [(r.name, r.src, r.dst) for r in pipe.plan.skips]


# -- several GPUs: a worker thread per device ----------------------------------------------

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


def _thread_names(pipe):
    """Wrap every stage call so it records the name of the thread it runs on."""
    import threading

    names: dict[int, set] = {j: set() for j in range(len(pipe._runtime.calls))}
    for j, call in enumerate(pipe._runtime.calls):
        def run(*args, fn=call.fn, j=j):
            names[j].add(threading.current_thread().name)
            return fn(*args)
        call.fn = run
    return names


@two_gpus
@pytest.mark.parametrize("devices", [["cuda:0", "cuda:1", "cuda:0", "cuda:1"], ["cuda:0", "cpu", "cuda:1", "cpu"]])
@pytest.mark.parametrize("name", ["unet", "transformer"])
def test_worker_thread_per_gpu_equal_to_eager(name, devices):
    model, args, _ = FACTORIES[name]()
    reference = copy.deepcopy(model)
    pipe = fxpipe.compile(model, 4, example_inputs=args, chunks=4, devices=devices)
    assert pipe._runtime.threads is not None and "rt.clock((" in pipe.code
    names = _thread_names(pipe)
    expected = reference(*args)
    expected.float().square().sum().backward()
    out = pipe(*args)
    out.float().square().sum().backward()
    assert max_relative_error(out.detach(), expected.detach()) < 1e-5
    grads = dict(reference.named_parameters())
    for pname, p in model.named_parameters():
        assert max_relative_error(p.grad, grads[pname].grad) < 1e-5, pname
    for j, d in enumerate(devices):
        assert any(n.startswith(f"fxpipe-{d}") for n in names[j]), (j, names[j])


@two_gpus
@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_worker_thread_per_gpu_action_schedules(schedule):
    tokens, target = torch.randint(0, 32, (8, 8)), torch.randint(0, 32, (8, 8))

    def loss_fn(logits, tgt):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1).to(logits.device))

    loss_error, (grad_error, name) = _step_errors(TiedTransformer(), tokens, target, loss_fn, n_stages=4,
                                                  chunks=4, schedule=schedule,
                                                  devices=["cuda:0", "cuda:1", "cuda:0", "cuda:1"])
    assert loss_error < 1e-5 and grad_error < 1e-5, (loss_error, grad_error, name)
