"""``torch.distributed.pipelining``'s split markers as fxpipe split points.

A model written for ``torch.distributed.pipelining`` marks where stages begin with
``pipe_split()`` calls in its ``forward``, or gets them from ``split_spec={fqn:
SplitPoint.BEGINNING | SplitPoint.END}``. fxpipe reads both, without patching the model:

- ``torch.export`` keeps every ``pipe_split()`` as a ``torch.ops.pippy._pipe_split`` node; the fx
  tracer would run it as a constant (it takes no proxies) and leave no trace, so
  :func:`recording_markers` records the call as that same node while fxpipe traces;
- ``split_spec`` names modules; a ``BEGINNING`` point cuts before the first node the module
  runs, an ``END`` point after its last (a module called twice: its first and last nodes).

Each marker becomes the split point "the stage begins at the first compute node after it"::

    x = self.lin0(x)          lin0          stage 0
    pipe_split()              _pipe_split   stage 0 (a no-op, left in place)
    x = torch.relu(x)         relu          stage 1 begins here: split point "relu"

Reads:  the graph (``nn_module_stack`` meta and ``call_module`` targets for ``split_spec``).
Writes: nothing; the marker nodes stay in the graph and run as no-ops in their stage.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from typing import Any

import torch
import torch.fx
from torch.overrides import TorchFunctionMode

__all__ = ["is_marker", "marked_split_points", "recording_markers", "resolve_split_points"]

_MARKER = "pippy._pipe_split"
_COMPUTE = ("call_module", "call_function", "call_method")


def is_marker(node: torch.fx.Node) -> bool:
    """Tell whether ``node`` is a ``pipe_split()`` marker."""
    return node.op == "call_function" and str(node.target) in (_MARKER, _MARKER + ".default")


class _Recorder(TorchFunctionMode):
    """Record each ``pipe_split()`` call as a marker node of the graph being traced."""

    def __init__(self, tracer: torch.fx.Tracer) -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        """Record a ``pipe_split()`` call as a node; run any other function as is."""
        if str(func) in (_MARKER, _MARKER + ".default"):
            self.tracer.create_proxy("call_function", torch.ops.pippy._pipe_split.default, (), {})
            return None
        return func(*args, **(kwargs or {}))


def recording_markers(tracer: torch.fx.Tracer) -> Any:
    """Return a context in which ``tracer`` records ``pipe_split()`` calls as graph nodes.

    A no-op context unless ``torch.distributed.pipelining`` (which defines ``pipe_split``)
    has been imported.
    """
    if "torch.distributed.pipelining" not in sys.modules:
        return nullcontext()
    return _Recorder(tracer)


def _modules_of(node: torch.fx.Node) -> set[str]:
    """Return the qualified names of the modules a node runs inside (and the one it calls)."""
    paths = {path for path, _ in (node.meta.get("nn_module_stack") or {}).values()}
    if node.op == "call_module":
        paths.add(str(node.target))
    return {p for p in paths if p}


def _in(paths: set[str], fqn: str) -> bool:
    """Tell whether any of ``paths`` is module ``fqn`` or inside it."""
    return any(p == fqn or p.startswith(fqn + ".") for p in paths)


def _kind(point: Any, fqn: str) -> str:
    """Return ``"BEGINNING"`` or ``"END"`` for a ``SplitPoint`` (or its name)."""
    name = str(getattr(point, "name", point)).upper()
    if name not in ("BEGINNING", "END"):
        raise ValueError(f"split_spec[{fqn!r}] = {point!r}; use SplitPoint.BEGINNING or SplitPoint.END "
                         "(from torch.distributed.pipelining)")
    return name


def marked_split_points(gm: torch.fx.GraphModule,
                        split_spec: Mapping[str, Any] | None = None) -> list[str] | None:
    """Return the compute nodes where the marked stages begin, in graph order; None if nothing is marked.

    Raises ValueError for a marker before all computation or after it (an empty stage), and
    for a ``split_spec`` module that forward never runs.
    """
    compute = [n for n in gm.graph.nodes if n.op in _COMPUTE]
    work = [i for i, n in enumerate(compute) if not is_marker(n)]
    starts: set[int] = set()

    def begin_after(i: int, what: str) -> None:
        """Begin a stage at the first compute node after position ``i``."""
        nxt = [k for k in work if k > i]
        if not nxt:
            raise ValueError(f"{what} comes after the model's last computation, which leaves the "
                             "last stage empty; drop it")
        starts.add(nxt[0])

    for i, node in enumerate(compute):
        if is_marker(node):
            begin_after(i, "a pipe_split() marker")
    for fqn, point in (split_spec or {}).items():
        kind = _kind(point, fqn)
        mine = [k for k in work if _in(_modules_of(compute[k]), fqn)]
        if not mine:
            raise ValueError(f"split_spec names {fqn!r}, which is no module that forward runs; use "
                             "qualified names from model.named_modules()")
        if kind == "BEGINNING":
            starts.add(mine[0])
        else:
            begin_after(mine[-1], f"split_spec {{{fqn!r}: SplitPoint.END}}")
    if not starts:
        return None
    if work and work[0] in starts:
        raise ValueError(f"a split marker comes before the model's first computation "
                         f"({compute[work[0]].name!r}), which leaves stage 0 empty; drop it")
    return [compute[i].name for i in sorted(starts)]


def resolve_split_points(gm: torch.fx.GraphModule, n_stages: int, split_points: Sequence[str] | None,
                         split_spec: Mapping[str, Any] | None, planned: bool) -> Sequence[str] | None:
    """Return the split points ``compile`` uses: the given ones, else the model's markers, else None.

    ``split_points=`` (or a saved ``plan=``) overrides the markers; passing ``split_spec=``
    with either is refused. Raises ValueError when the markers make another number of
    stages than ``n_stages``.
    """
    if split_spec is not None:
        if not isinstance(split_spec, Mapping):
            raise TypeError(f"split_spec must map module names to SplitPoint, got {type(split_spec).__name__}")
        if split_points is not None or planned:
            raise ValueError("pass split_spec= or " + ("plan=" if planned else "split_points=")
                             + ", not both: each says where stages begin")
    if split_points is not None or planned:
        return split_points
    marked = marked_split_points(gm, split_spec)
    if marked is not None and len(marked) + 1 != n_stages:
        raise ValueError(f"the model's split markers (pipe_split() calls and split_spec) make "
                         f"{len(marked) + 1} stages, beginning at {marked}, but n_stages={n_stages}; "
                         f"pass n_stages={len(marked) + 1}, or split_points= to cut elsewhere")
    return marked
