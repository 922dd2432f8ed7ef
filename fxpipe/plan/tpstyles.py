"""PyTorch's parallel styles as fxpipe reads them: what a styled module reads, gives and communicates.

    ColwiseParallel()        reads the whole input, gives a local shard of its last dim; backward
                             all-reduces the input's gradient
    RowwiseParallel()        reads a local shard of the last dim, gives the whole (a forward all-reduce)
    SequenceParallel(), PrepareModuleInput/Output(...)   their layouts, as declared

:func:`rule_of` turns a style into the :class:`~fxpipe.passes.tplayout.Rule` the layout
propagation follows, refusing a style on a module it cannot apply to; :func:`style_text` names
a style as it would be written (so two plans compare by text); :func:`collectives` lists the
collectives a styled call runs per micro-batch, from the layouts around it.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from fxpipe.passes.tpauto import TensorParallelError
from fxpipe.passes.tplayout import Rule
from fxpipe.passes.tpsites import Site

__all__ = ["STYLE_OF_ROLE", "collectives", "rule_of", "style_text", "weight_placement"]

STYLE_OF_ROLE = {
    "colwise": lambda: ColwiseParallel(),
    "rowwise": lambda: RowwiseParallel(),
    "vocab": lambda: RowwiseParallel(input_layouts=Replicate()),
    "gather": lambda: ColwiseParallel(output_layouts=Replicate()),
}
_KNOWN = "ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput, PrepareModuleOutput"


def _token(placement: Any) -> str:
    """Return a placement as a propagation token: ``R``, ``S<d>``."""
    if placement is None or isinstance(placement, Replicate):
        return "R"
    if isinstance(placement, Shard):
        return f"S{placement.dim}"
    raise TensorParallelError(f"layout {placement!r}: fxpipe follows Replicate() and Shard(d) between modules "
                              "(a Partial() value must be reduced inside its module)")


def _text(placement: Any) -> str:
    """Name a placement as it is written."""
    return "Replicate()" if isinstance(placement, Replicate) else f"Shard({placement.dim})" \
        if isinstance(placement, Shard) else repr(placement)


def style_text(style: ParallelStyle) -> str:
    """Name a style as it would be written, defaults left out (``RowwiseParallel(input_layouts=Replicate())``)."""
    name = type(style).__name__
    args = []
    if isinstance(style, (ColwiseParallel, RowwiseParallel)):
        col = isinstance(style, ColwiseParallel)
        default_in, default_out = (Replicate(), Shard(-1)) if col else (Shard(-1), Replicate())
        if style.input_layouts[0] != default_in:
            args.append(f"input_layouts={_text(style.input_layouts[0])}")
        if style.output_layouts[0] != default_out:
            args.append(f"output_layouts={_text(style.output_layouts[0])}")
        if not style.use_local_output:
            args.append("use_local_output=False")
    elif isinstance(style, SequenceParallel):
        if style.sequence_sharding[0].dim != 1:
            args.append(f"sequence_dim={style.sequence_sharding[0].dim}")
        if style.use_local_output:
            args.append("use_local_output=True")
    elif isinstance(style, PrepareModuleInput):
        args.append(f"input_layouts={tuple(style.input_layouts or ())}, "
                    f"desired_input_layouts={tuple(style.desired_input_layouts or ())}")
    elif isinstance(style, PrepareModuleOutput):
        args.append(f"output_layouts={tuple(style.output_layouts)}, "
                    f"desired_output_layouts={tuple(style.desired_output_layouts)}")
    return f"{name}({', '.join(args)})"


def _local(token: str, use_local: bool) -> str:
    """Return what a style gives: the token of its layout, or a DTensor."""
    return token if use_local else "D"


def rule_of(style: Any, site: Site, t: int) -> Rule:
    """Return what ``style`` on ``site`` reads and gives; refuse a style the site cannot take."""
    text = style_text(style) if isinstance(style, ParallelStyle) else repr(style)
    where = f"{text} on '{site.fqn}' ({site.module_type})"
    if isinstance(style, (ColwiseParallel, RowwiseParallel)):
        if site.kind not in ("linear", "embedding"):
            raise TensorParallelError(f"{where}: {type(style).__name__} applies to nn.Linear and nn.Embedding only; "
                                      "style the linears inside it, or use SequenceParallel / PrepareModuleInput")
        col = isinstance(style, ColwiseParallel)
        if site.kind == "embedding" and not col and not isinstance(style.input_layouts[0], Replicate):
            raise TensorParallelError(f"{where}: RowwiseParallel reads an embedding's indices as "
                                      f"{_text(style.input_layouts[0])} (its default); the indices are whole on every "
                                      "rank: pass RowwiseParallel(input_layouts=Replicate())")
        _divides(style, site, t, col)
        takes = _token(style.input_layouts[0])
        return Rule(f"{takes}|D", _local(_token(style.output_layouts[0]), style.use_local_output), text)
    if isinstance(style, SequenceParallel):
        token = _token(style.sequence_sharding[0])
        return Rule(f"{token}|D", _local(token, style.use_local_output), text)
    if isinstance(style, PrepareModuleInput):
        desired = [p for p in style.desired_input_layouts or () if p is not None]
        if any(not isinstance(p, Replicate) for p in desired):
            raise TensorParallelError(f"{where}: on a leaf module fxpipe follows PrepareModuleInput only into "
                                      "Replicate() (the module's own output layout is then the whole value)")
        first = style.input_layouts[0] if style.input_layouts else None
        return Rule("*" if first is None else f"{_token(first)}|D", _local("R", style.use_local_output), text)
    if isinstance(style, PrepareModuleOutput):
        return Rule("R", _local(_token(style.desired_output_layouts[0]), style.use_local_output), text)
    raise TensorParallelError(f"{where}: fxpipe knows {_KNOWN}, not {type(style).__name__}")


def _divides(style: Any, site: Site, t: int, col: bool) -> None:
    """Refuse a linear or embedding whose sharded dimension ``t`` does not divide."""
    from fxpipe.passes.tpauto import indivisible

    rows = (col and site.kind == "linear") or (not col and site.kind == "embedding")
    size = site.out_features if rows else site.in_features
    if size % t:
        what = {("linear", True): "the output features", ("linear", False): "the input features",
                ("embedding", True): "the embedding width", ("embedding", False): "the vocabulary"}
        raise indivisible(what[(site.kind, col)], site.fqn, size, t)


def weight_placement(style: Any, site: Site) -> str | None:
    """Return how ``style`` places ``site``'s weight: ``"S0"``, ``"S1"``, ``"R"`` (a DTensor) or None (as it is)."""
    if isinstance(style, (ColwiseParallel, RowwiseParallel)):
        col = isinstance(style, ColwiseParallel)
        return "S0" if col == (site.kind == "linear") else "S1"
    if isinstance(style, SequenceParallel):
        return "R"
    return None


def collectives(style: Any, reads: Any, gives: Any, in_bytes: int, out_bytes: int, wants_grad: bool,
                param_bytes: int) -> list[tuple[str, str, int]]:
    """Return ``(pass, collective, bytes)`` a styled call runs per call: PyTorch's redistributions around it.

    ``reads`` and ``gives`` are the layouts propagated around the call (None: whole, an int: a
    local shard); bytes are the global value's.
    """
    out: list[tuple[str, str, int]] = []
    if isinstance(style, (ColwiseParallel, RowwiseParallel)):
        col = isinstance(style, ColwiseParallel)
        if col:
            if isinstance(reads, int):  # a shard gathered into the whole input
                out += [("forward", "all_gather", in_bytes), ("backward", "reduce_scatter", in_bytes)]
            elif wants_grad:  # the whole input's gradient is a partial sum
                out.append(("backward", "all_reduce", in_bytes))
            if gives is None and isinstance(style.output_layouts[0], Replicate):
                out.append(("forward", "all_gather", out_bytes))
        else:
            placement = style.output_layouts[0]
            if isinstance(placement, Replicate):
                out.append(("forward", "all_reduce", out_bytes))
            elif isinstance(placement, Shard):
                out += [("forward", "reduce_scatter", out_bytes), ("backward", "all_gather", out_bytes)]
            if reads is None and wants_grad and not isinstance(placement, Partial):
                out.append(("backward", "all_gather", in_bytes))
    elif isinstance(style, SequenceParallel):
        out.append(("backward", "all_reduce", param_bytes))  # the replicated weights' partial gradients
    elif isinstance(style, (PrepareModuleInput, PrepareModuleOutput)) and isinstance(reads, int):
        out += [("forward", "all_gather", in_bytes), ("backward", "reduce_scatter", in_bytes)]
    return out
