"""Part ``overhead`` of ``gpu_check.py``: fxpipe on one GPU against eager PyTorch on that GPU.

Every stage on cuda:0, so nothing overlaps and the pipeline can only cost: a training step of
the residual MLP under fxpipe (1, 2 and 4 stages; GPipe and 1F1B) against eager PyTorch over
the whole batch, and against eager over the same m micro-batches (the limit: the pipeline's
own work with none of its bookkeeping). Median step times from one interleaved run
(:func:`gpu_measure.race`); the ratio to the limit is fxpipe's overhead on a GPU.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(BENCH), BENCH]
from gpu_measure import race

SIZES = {"gpu": {"d": 1024, "hidden": 4096, "blocks": 8, "batch": 4096, "m": 8},
         "standin": {"d": 16, "hidden": 16, "blocks": 4, "batch": 32, "m": 4}}


def measure_overhead(seconds: float, rows: list, standin: bool) -> None:
    """Time fxpipe's stages all on one GPU against eager over the batch and over its micro-batches."""
    import copy

    import torch.nn.functional as F
    from distributed import ResidualMLP

    import fxpipe

    s = SIZES["standin" if standin else "gpu"]
    gpu = "cpu" if standin else "cuda:0"
    torch.manual_seed(0)
    base = ResidualMLP(s["d"], s["hidden"], s["blocks"])
    x, y = torch.randn(s["batch"], s["d"], device=gpu), torch.randn(s["batch"], s["d"], device=gpu)
    keep: list[Any] = []
    runs: dict[str, Callable[[], Any]] = {}

    eager = copy.deepcopy(base).to(gpu)
    keep.append(eager)

    def whole() -> None:
        eager.zero_grad(set_to_none=True)
        F.mse_loss(eager(x), y).backward()

    def limit() -> None:
        eager.zero_grad(set_to_none=True)
        for xs, ys in zip(x.chunk(s["m"]), y.chunk(s["m"])):
            (F.mse_loss(eager(xs), ys) / s["m"]).backward()
    runs["eager, whole batch"], runs["eager, m micro-batches"] = whole, limit
    for k, schedule in ((1, "gpipe"), (2, "gpipe"), (2, "1f1b"), (4, "gpipe"), (4, "1f1b")):
        model = copy.deepcopy(base)
        pipe = fxpipe.compile(model, k, example_inputs=(x.cpu(),), chunks=s["m"], devices=[gpu] * k,
                              checkpoint="never", schedule=schedule)
        keep.append((model, pipe))

        def step(pipe: Any = pipe, model: Any = model) -> None:
            model.zero_grad(set_to_none=True)
            pipe.step(x, target=y, loss_fn=F.mse_loss)
        runs[f"fxpipe {k} stage(s), {schedule}"] = step
    med = race(runs, seconds, [gpu], most=3 if standin else 15)
    what = f"residual MLP d={s['d']} hidden={s['hidden']} blocks={s['blocks']}, batch {s['batch']}, m={s['m']}"
    rows.append(["overhead", "eager step, whole batch", f"{med['eager, whole batch'] * 1e3:.1f} ms", what])
    rows.append(["overhead", "eager step over the m micro-batches (the limit)",
                 f"{med['eager, m micro-batches'] * 1e3:.1f} ms", "the baseline of the ratios below"])
    for name, t in med.items():
        if name.startswith("fxpipe"):
            rows.append(["overhead", f"{name} on {gpu} / the limit", f"{t / med['eager, m micro-batches']:.3f}",
                         f"{t * 1e3:.1f} ms; whole batch / this = {med['eager, whole batch'] / t:.3f}"])
    del keep, runs
    if not standin:
        torch.cuda.empty_cache()
