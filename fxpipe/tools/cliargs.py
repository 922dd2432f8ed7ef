"""What the ``fxpipe`` commands share: their two kinds of error and the parsers of their options."""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from typing import Any

from torch import nn

__all__ = ["Failure", "UsageError", "add_export_dims", "add_tracer", "check_export_dims_args", "count",
           "join_negative_values", "leaf_modules", "names", "option_hint", "positive", "shape", "trace_hint"]


class UsageError(Exception):
    """A command line that cannot be used; exit status 2."""


class Failure(Exception):
    """A model that cannot be inspected as asked; exit status 1."""


def join_negative_values(argv: Sequence[str]) -> list[str]:
    """Write ``--opt -5GB`` as ``--opt=-5GB``, so the option's own check, not argparse's, refuses the value."""
    joined: list[str] = []
    for token in argv:  # argparse takes "-5GB" for an option and says only "expected one argument"
        if (joined and _NEGATIVE.match(token) and joined[-1].startswith("--") and "=" not in joined[-1]
                and joined[-1] != "--"):
            joined[-1] = f"{joined[-1]}={token}"
        else:
            joined.append(token)
    return joined


_NEGATIVE = re.compile(r"^-\d")


def positive(text: str) -> int:
    """Parse a positive integer option."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def count(text: str) -> int:
    """Parse a whole number option that may be 0 (a number of warm-up steps)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number (0 or more)")
    return value


def counts(text: str) -> list[int]:
    """Parse a comma-separated list of positive integers (stage counts, chunks, tensor-parallel sizes)."""
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of positive integers, e.g. 1,2,4,8")
    return values


def names(text: str) -> list[str]:
    """Parse a comma-separated list of names."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r} names nothing; separate names with commas")
    return names


def device_names(text: str) -> list[str]:
    """Parse a comma-separated list of torch device names (``cpu``, ``cuda``, ``cuda:1``)."""
    import torch

    found = names(text)
    for name in found:
        try:
            torch.device(name)
        except RuntimeError:
            raise argparse.ArgumentTypeError(f"{name!r} is no torch device: use cpu, cuda or cuda:N") from None
    return found


def leaf_modules(model: Any, given: list[str] | None) -> list[Any]:
    """Read ``--leaf-modules``: a submodule's qualified name stays a name, a class name becomes the class.

    ``--leaf-modules LlamaDecoderLayer`` keeps every module of that class as one call, as
    ``fxpipe.compile(leaf_modules=[LlamaDecoderLayer])`` does. A name that is neither is left
    for the tracer to refuse, listing the model's submodules.
    """
    if not given or not isinstance(model, nn.Module):
        return list(given or [])
    qualified = {name for name, _ in model.named_modules()}
    classes = {type(m).__name__: type(m) for _, m in model.named_modules()}
    return [n if n in qualified or n not in classes else classes[n] for n in given]


def shape(text: str) -> tuple[int, ...]:
    """Parse a shape such as 8,3,224,224."""
    try:
        shape = tuple(int(t) for t in text.replace("x", ",").split(","))
    except ValueError:
        shape = ()
    if not shape or any(d < 1 for d in shape):
        raise argparse.ArgumentTypeError(f"{text!r} is not a shape; write sizes with commas, e.g. 8,3,224,224")
    return shape


def add_tracer(p: argparse.ArgumentParser) -> None:
    """Add ``--tracer``: the front end that makes the model's graph (fxpipe.compile's ``tracer=``)."""
    p.add_argument("--tracer", choices=["fx", "export"], default="fx",
                   help="front end: fx (torch.fx, the default) or export (torch.export on the example inputs; "
                        "Hugging Face transformers 5 models need it); a saved plan records it")


def add_export_dims(p: argparse.ArgumentParser) -> None:
    """Add ``--export-dims``: which dims torch.export keeps dynamic (fxpipe.compile's ``export_dims=``)."""
    p.add_argument("--export-dims", choices=["auto", "batch"], default="auto",
                   help="with --tracer export: auto (dim 0 dynamic, the other dims as free as the model allows; the "
                        "default) or batch (the other dims the example's: a shorter export where torch.export's "
                        "reasoning over symbolic sizes is slow)")


def check_export_dims_args(args: argparse.Namespace) -> None:
    """Refuse ``--export-dims`` other than auto without ``--tracer export`` (a usage mistake, exit 2)."""
    if args.export_dims != "auto" and args.tracer != "export":
        raise UsageError(f"--export-dims {args.export_dims} sets which dims torch.export keeps dynamic, but the tracer "
                         f"is {args.tracer}: pass --tracer export with it, or leave --export-dims out")


def trace_hint(exc: Exception) -> str:
    """Say which command-line options apply the fixes a TraceError names (leaf modules, the export front end)."""
    module = getattr(exc, "module", None)
    hints = [f"--leaf-modules {module}"] if module else []
    if "tracer='export'" in str(exc):
        hints.append("--tracer export")
    return f"\nOn the command line: {' or '.join(hints)}" if hints else ""


# the keyword a library message names, and the option of `fxpipe inspect` that sets it
_OPTIONS = {"checkpoint=": "--checkpoint", "max_memory": "--max-memory", "n_stages=": "--stages", "chunks=": "--chunks",
            "split_points=": "--split-points", "stages_per_rank=": "--stages-per-rank"}


def does_not_run(exc: RuntimeError) -> Failure:
    """Return the failure of a model that does not run on its example inputs (the shape pass ran it on fakes)."""
    lines = [line for line in str(exc).splitlines() if line.strip()
             and not line.startswith(("Original traceback", "None", "Use tlparse"))]
    return Failure("the model does not run on the example inputs: " + "\n".join(lines))


def option_hint(message: str) -> str:
    """Say which command-line options set the keywords a library message names (``max_memory=`` is ``--max-memory``)."""
    hints = [f"{keyword.rstrip('=')}= is {option}" for keyword, option in _OPTIONS.items() if keyword in message]
    return f"\nOn the command line, {', '.join(hints)}" if hints else ""


def rows_text(batch: float, chunks: int) -> str:
    """Write a micro-batch's rows: one number, or the least and most where the batch does not divide evenly."""
    if batch != int(batch):
        return f"{batch / chunks:g}"
    from fxpipe.plan.batches import micro_sizes

    sizes = micro_sizes(int(batch), chunks)
    return f"{min(sizes)}" if min(sizes) == max(sizes) else f"{min(sizes)}-{max(sizes)}"
