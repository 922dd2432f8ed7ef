"""The single-process runtime frees each activation and skip as soon as its last consumer ran."""

import copy
import weakref

import pytest
import torch
from torch import nn

import fxpipe


class SkipNet(nn.Module):
    """Three stages with a skip from the first to the last."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(64, 64) for _ in range(4))

    def forward(self, x):
        s = torch.relu(self.a(x))
        h = torch.relu(self.b(s))
        h = torch.relu(self.c(h))
        return self.d(h) + s


def _peak_live_outputs(chunks: int) -> int:
    """Run under no_grad; return the most outputs of stages 0 and 1 alive when stage 2 runs.

    (The last stage's outputs are the pipeline's result, kept to be gathered.)
    """
    model = SkipNet()
    pipe = fxpipe.compile(model, 3, example_inputs=(torch.randn(4, 64),), chunks=chunks,
                          split_points=["b", "d"], devices=["cpu"] * 3)
    calls = pipe._runtime.calls
    live: list[weakref.ref] = []
    peak = 0

    def record(fn):
        def run(*args):
            out = fn(*args)
            live.extend(weakref.ref(v) for v in out if isinstance(v, torch.Tensor))
            return out
        return run

    def count(fn):
        def run(*args):
            nonlocal peak
            peak = max(peak, sum(r() is not None for r in live))
            return fn(*args)
        return run

    calls[0].fn, calls[1].fn, calls[2].fn = record(calls[0].fn), record(calls[1].fn), count(calls[2].fn)
    with torch.no_grad():
        pipe(torch.randn(4 * chunks, 64))
    return peak


def test_activations_and_skips_freed_after_last_use():
    # Kept to the end, stage 0's two outputs (a boundary value and a skip) and stage 1's one
    # output per micro-batch would all be alive at the last compute: 3 * chunks. Freed after
    # their last use, the live set is what a few clock cycles hold, whatever the chunks.
    peaks = [_peak_live_outputs(chunks) for chunks in (4, 16)]
    assert peaks[0] == peaks[1] <= 6, peaks


def test_same_device_stages_get_no_copies():
    pipe = fxpipe.compile(SkipNet(), 3, example_inputs=(torch.randn(4, 64),), chunks=4,
                          devices=["cpu"] * 3)
    assert "copy(" not in pipe.code.split('"""', 2)[2].replace("compute, copy, depend", "")


def test_worker_threads_compute_a_clock_together_and_equal_eager(monkeypatch):
    # "cpu" and "cpu:0" count as two devices, so two worker threads run each clock's stages
    # concurrently, as they do on CUDA by default.
    from models import transformer, unet

    from fxpipe.runtime.local import LocalRuntime
    from fxpipe.testing import assert_pipeline_equivalent

    init = LocalRuntime.__init__

    def threaded(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.use_threads(True)

    monkeypatch.setattr(LocalRuntime, "__init__", threaded)
    for factory in (unet, transformer):
        model, args, _ = factory()
        pipe = assert_pipeline_equivalent(model, args, n_stages=4, chunks=4,
                                          devices=["cpu", "cpu:0", "cpu", "cpu:0"])
        assert "rt.clock((" in pipe.code
        assert len(pipe._runtime.threads.pools) == 2


@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_worker_threads_run_a_clock_of_actions_together_and_equal_eager(monkeypatch, schedule):
    from models import TiedTransformer

    from fxpipe.runtime.local import LocalRuntime
    from fxpipe.runtime.stage import threads
    from fxpipe.testing import max_relative_error

    init = LocalRuntime.__init__

    def threaded(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.use_threads(True)

    ran = []
    run = threads.DeviceThreads.run
    monkeypatch.setattr(LocalRuntime, "__init__", threaded)
    monkeypatch.setattr(threads.DeviceThreads, "run", lambda self, tasks: (ran.append(len(tasks)), run(self, tasks))[1])
    torch.manual_seed(0)
    model = TiedTransformer()
    tokens = torch.randint(0, 32, (8, 8))
    eager = copy.deepcopy(model)
    loss_fn = lambda out, _: out.float().pow(2).mean()  # noqa: E731
    loss_fn(eager(tokens), None).backward()
    pipe = fxpipe.compile(model, 4, example_inputs=(tokens,), chunks=4, schedule=schedule,
                          devices=["cpu", "cpu:0", "cpu", "cpu:0"])
    pipe.step(tokens, target=None, loss_fn=loss_fn)
    assert ran and max(ran) >= 2  # some clocks ran two stages at once
    grads = dict(eager.named_parameters())
    for name, p in model.named_parameters():
        assert max_relative_error(p.grad, grads[name].grad) < 1e-5, name
