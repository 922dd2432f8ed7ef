"""Compare fxpipe's front ends: what fx tracing and torch.export trace, and how long they take.

    python benchmarks/front_ends.py            # prints a Markdown table

For each model: seconds to trace with the fx front end (fxpipe's symbolic tracer, or the
model's own tracer where it needs one: Hugging Face's ``transformers.utils.fx``) and with
``tracer="export"`` (torch.export, dim 0 dynamic), the node count of each graph, and the
ratio export / fx measured in the same run. A model whose modules read ``self.training`` is
exported in both modes and the graphs merged (so the pipe follows ``pipe.train()``/``pipe.eval()``);
"export 2 modes / 1" is that time against the time with the second export left out, measured
in the same run (fx traced such models twice already, to find their branches on the mode). Models whose packages are missing are left out. Each time is the
best of ``--repeat`` runs (default 3).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from typing import Any, Callable
from unittest import mock

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples"), os.path.join(ROOT, "tests", "support")]

import fxpipe  # noqa: E402
from models import FACTORIES  # noqa: E402


def _models() -> list[tuple[str, Callable[[], tuple[torch.nn.Module, tuple, dict]], Any]]:
    """Return (name, factory, fx tracer) for the test zoo and the third-party models present."""
    out = [(name, f, "fx") for name, f in sorted(FACTORIES.items())]
    try:
        import test_real_models as real
    except ImportError:
        return out
    for case in real.CASES:
        if case.tracer == "export":
            continue
        try:
            __import__(case.package)
        except ImportError:
            continue
        out.append((case.name, case.build, case.tracer))
    return out


def _best(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    """Return the best wall time of ``repeat`` calls and the last result."""
    best, result = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def _one_mode() -> contextlib.AbstractContextManager:
    """Leave out the export of the other mode (what fxpipe exported before it followed pipe.eval())."""
    return mock.patch("fxpipe.frontend.export._other_mode", return_value=None)


def main() -> None:
    """Trace every model with both front ends and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--only", nargs="*", help="model names to run")
    opts = parser.parse_args()
    rows = []
    for name, factory, tracer in _models():
        if opts.only and name not in opts.only:
            continue
        torch.manual_seed(0)
        model, args, kwargs = factory()
        model.eval()
        fx_s, gm = _best(lambda: fxpipe.trace(model, tracer=tracer), opts.repeat)

        def exported() -> torch.fx.GraphModule:
            return fxpipe.trace(model, tracer="export", example_inputs=args, example_kwargs=kwargs)

        try:
            ex_s, egm = _best(exported, opts.repeat)
            with _one_mode():
                ex_one, _ = _best(exported, opts.repeat)
            export = (f"{ex_s:.2f}", str(len(egm.graph.nodes)), f"{ex_s / fx_s:.1f}x", f"{ex_s / ex_one:.2f}")
        except Exception as exc:  # noqa: BLE001 - a row that says what failed
            export = ("fails", type(exc).__name__, "", "")
        front = "fx" if tracer == "fx" else ("HF fx" if "hf" in getattr(tracer, "__qualname__", "")
                                              else "timm fx")
        rows.append([name, front, f"{fx_s:.3f}", str(len(gm.graph.nodes)), *export])
        print(f"done {name}", file=sys.stderr, flush=True)
    head = ["model", "fx tracer", "fx s", "fx nodes", "export s", "export nodes", "export / fx", "export 2 modes / 1"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
