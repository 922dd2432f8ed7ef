"""Parts 2 and 3 of ``gpu_check.py``: copy streams against the compute stream, and speedup.

``race`` times runs against each other (shuffled each round, Python's collector paused while
timing); ``overlap`` reads a timeline's events for the share of copy time under compute.
"""

from __future__ import annotations

import functools
import gc
import os
import random
import statistics
import sys
import time
from typing import Any, Callable

import torch

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(BENCH), BENCH]  # fxpipe, and distributed.py's model

COMPUTE = ("forward", "recompute", "backward", "weight")

def sync(devices: Any) -> None:
    """Wait for the work queued on every CUDA device among ``devices``."""
    for d in {torch.device(d) for d in devices}:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def race(runs: dict[Any, Callable[[], Any]], seconds: float, devices: Any, most: int = 15) -> dict[Any, float]:
    """Warm each run up, then time them until ``seconds`` or ``most`` rounds; return median seconds.

    Each round runs every run once, in an order shuffled anew (a run pays for what the one
    before it left), with Python's cyclic collector run before and paused during each.
    """
    start = time.monotonic()
    for fn in runs.values():
        fn()
    sync(devices)
    times: dict[Any, list[float]] = {k: [] for k in runs}
    rounds = 0
    while True:
        order = list(runs)
        random.Random(rounds).shuffle(order)
        for name in order:
            gc.collect()
            gc.disable()
            t = time.perf_counter()
            runs[name]()
            sync(devices)
            times[name].append(time.perf_counter() - t)
            gc.enable()
        rounds += 1
        per_round = (time.monotonic() - start) / (rounds + 1)
        if rounds >= most or (rounds >= 3 and time.monotonic() + per_round > start + seconds):
            break
    return {k: statistics.median(v) for k, v in times.items()}


def overlap(events: list[dict[str, Any]]) -> tuple[float, float]:
    """Return the copies' total time (ms) and the fraction of it during which some stage computes."""
    merged: list[list[float]] = []
    for a, b in sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["cat"] in COMPUTE):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    total = covered = 0.0
    for e in events:
        if e["cat"] == "copy":
            a, b = e["ts"], e["ts"] + e["dur"]
            total += b - a
            covered += sum(max(0.0, min(b, hi) - max(a, lo)) for lo, hi in merged)
    return total / 1e3, (covered / total if total else 0.0)


# -- 2. copies on copy streams against copies on the compute stream ------------------------

def _alternating(d: int, layers: int):
    """Return a model of four parts: heavy (for the GPU), light (CPU), heavy, light."""
    from torch import nn

    class Light(nn.Module):
        def forward(self, x):
            return x * torch.sigmoid(x)

    def heavy():
        return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(d, d), nn.ReLU())])

    class Alternating(nn.Module):
        def __init__(self):
            super().__init__()
            self.g0, self.c1, self.g2, self.c3 = heavy(), Light(), heavy(), Light()

        def forward(self, x):
            return self.c3(self.g2(self.c1(self.g0(x))))
    return Alternating()


def copies_on_compute_stream(pipe) -> None:
    """Make every copy of ``pipe`` run on the compute stream of its device (no copy streams)."""
    from fxpipe.runtime.stage.stream import current_stream

    for call in pipe._runtime.calls:
        def on_compute(i: int, device: torch.device = call.device) -> Any:
            return current_stream(device)
        call.copy_stream = on_compute  # an instance attribute over StageCall.copy_stream(i)


def measure_copies(out: str, seconds: float, rows: list, standin: bool) -> None:
    """Time GPipe and 1F1B steps over cuda:0 and the CPU with and without copy streams; overlap."""
    import torch.nn.functional as F

    import fxpipe

    gpu = "cpu:0" if standin else "cuda:0"
    devices = [gpu, "cpu", gpu, "cpu"]
    d, layers, batch, m = (64, 2, 64, 4) if standin else (4096, 4, 4096, 8)
    x, y = torch.randn(batch, d), torch.randn(batch, d)
    pipes = {}
    for streams in ("on", "off"):
        for schedule in ("gpipe", "1f1b"):
            torch.manual_seed(0)
            model = _alternating(d, layers)
            pipe = fxpipe.compile(model, 4, example_inputs=(x,), chunks=m, devices=devices, checkpoint="never",
                                  split_points=["c1", "g2", "c3"], schedule=schedule)
            if streams == "off":
                copies_on_compute_stream(pipe)
            pipes[(schedule, streams)] = (pipe, model)

    def step(key: tuple[str, str]) -> None:
        pipe, model = pipes[key]
        model.zero_grad(set_to_none=True)
        pipe.step(x, target=y, loss_fn=F.mse_loss)

    what = f"4 stages {gpu}/cpu, d={d}, {layers} linears per GPU stage, batch {batch}, m={m}"
    runs: dict[Any, Callable[[], Any]] = {k: functools.partial(step, k) for k in pipes}
    med = race(runs, 0.75 * seconds, devices, most=3 if standin else 15)
    for schedule in ("gpipe", "1f1b"):
        on, off = med[(schedule, "on")], med[(schedule, "off")]
        rows.append(["copies", f"{schedule} step, copy streams on", f"{on * 1e3:.1f} ms", what])
        rows.append(["copies", f"{schedule} step, copies on the compute stream", f"{off * 1e3:.1f} ms",
                     f"on / off = {on / off:.3f}"])
    for streams in ("on", "off"):
        name = f"copies_streams_{streams}.json"
        with fxpipe.timeline(os.path.join(out, name)) as tl:
            step(("gpipe", streams))
        copy_ms, fraction = overlap(tl.events)
        rows.append(["copies", f"forward copy time overlapped by compute, streams {streams}",
                     f"{100 * fraction:.0f}%", f"{copy_ms:.1f} ms of copies in one gpipe step; {name}"])


# -- 3. speedup over one GPU ---------------------------------------------------------------

def measure_speedup(seconds: float, rows: list, gpus: list[str], standin: bool) -> None:
    """Time k = 1..4 stages on k GPUs at m = 8 and 32; speedup over k = 1 beside GPipe's bound."""
    import torch.nn.functional as F
    from distributed import ResidualMLP

    import fxpipe

    d, hidden, blocks, batch = (16, 16, 2, 32) if standin else (1024, 4096, 8, 8192)
    ks = [k for k in (1, 2, 3, 4) if k <= len(gpus)]
    x = torch.randn(batch, d)
    for m in (8, 32):
        runs: dict[Any, Callable[[], Any]] = {}
        keep = []
        for k in ks:
            torch.manual_seed(0)
            model = ResidualMLP(d, hidden, blocks)
            pipe = fxpipe.compile(model, k, example_inputs=(x,), chunks=m, devices=gpus[:k], checkpoint="never")
            xs, ys = x.to(gpus[0]), torch.randn(batch, d).to(gpus[k - 1])  # no input copies in the timing
            keep.append(model)

            def step(pipe=pipe, model=model, xs=xs, ys=ys):
                model.zero_grad(set_to_none=True)
                pipe.step(xs, target=ys, loss_fn=F.mse_loss)
            runs[k] = step
        med = race(runs, seconds / 2, gpus, most=3 if standin else 15)
        for k in ks[1:]:
            bound = k * m / (m + k - 1)
            speedup = med[1] / med[k]
            note = (f"GPipe bound {bound:.2f}x, {speedup / bound:.0%} of it; "
                    f"{med[k] * 1e3:.1f} ms vs {med[1] * 1e3:.1f} ms")
            rows.append(["speedup", f"{k} stages on {k} GPUs / 1 GPU, m={m}", f"{speedup:.2f}x", note])
        del runs, keep
        if not standin:
            torch.cuda.empty_cache()
    rows.append(["speedup", "model", f"residual MLP d={d} hidden={hidden} blocks={blocks}",
                 f"batch {batch}, checkpoint never, gpipe"])
