"""How much faster torch.compile makes a model's forward and backward, measured here, for ``simulate(compiled=)``.

    annotated graph ─▶ inputs of a micro-batch's rows ─▶ forward + backward, eager, then compiled
                    ─▶ the ratio of the medians (compiled / eager): the factor stage work is scaled by

The whole model is timed on copies of its parameters (its own gradients are untouched), after
untimed runs that compile it; the factor holds for every stage alike.
"""

from __future__ import annotations

import copy
import statistics
from typing import Any

import torch
import torch.fx
from torch.utils._pytree import tree_flatten

from fxpipe.passes.timing import seconds
from fxpipe.simulate.measure import inputs_of_rows

__all__ = ["check_factor", "compile_factor"]


def check_factor(compiled: Any) -> None:
    """Refuse a ``compiled=`` that is neither a positive factor, True, a dict of torch.compile's arguments nor None."""
    if compiled is None or compiled is True or isinstance(compiled, dict):
        return
    if isinstance(compiled, bool) or not isinstance(compiled, (int, float)) or not compiled > 0:
        raise ValueError(f"compiled={compiled!r}; use a factor > 0 (compiled seconds per eager second), True to "
                         "measure it here with inductor, or a dict of torch.compile's arguments to measure with")


def compile_factor(gm: torch.fx.GraphModule, rows: int, options: dict[str, Any] | None = None,
                   device: str | torch.device = "cpu", repeats: int = 5) -> float:
    """Return compiled seconds per eager second of ``gm``'s forward and backward on ``rows`` rows.

    ``options`` are torch.compile's (default: inductor); ``gm`` must be annotated
    (:func:`fxpipe.passes.annotate`), or its placeholders' shapes cannot be known.
    """
    dev = torch.device(device)
    args = tuple(a.to(dev) if isinstance(a, torch.Tensor) else a for a in inputs_of_rows(gm, rows))
    eager = copy.deepcopy(gm).to(dev)
    compiled_copy = copy.deepcopy(gm).to(dev)
    compiled = torch.compile(compiled_copy, **(options or {}))

    def step(fn: Any) -> Any:
        def run() -> None:
            outs = [t for t in tree_flatten(fn(*args))[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if outs:
                torch.stack([t.float().mean() for t in outs]).sum().backward()
        return run

    runs = {"eager": step(eager), "compiled": step(compiled)}
    for run in runs.values():  # the compile, and the first call's allocations, go untimed
        run()
        run()
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(repeats):  # alternate, so a change of load hits both alike
        for name, run in runs.items():
            times[name].append(seconds(run, dev))
    return statistics.median(times["compiled"]) / max(statistics.median(times["eager"]), 1e-12)
