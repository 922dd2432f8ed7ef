"""Draw a partitioned graph as Graphviz DOT: nodes clustered and coloured by stage.

Edges inside a stage are thin and grey. An edge into the next stage (a boundary value) is
solid and red; an edge that skips stages (a skip route, stashed by its producer and popped
by its consumer) is dashed and purple; a parameter read by a later stage is dotted. Labels
give bytes per micro-batch, as the plan's table does.
"""

from __future__ import annotations

import shutil
import subprocess
from typing import cast

import torch.fx

from fxpipe.plan.pipeline import PipelinePlan, human

__all__ = ["graphviz_available", "render", "to_dot"]

# Tableau 10: (cluster border, node fill) per stage, cycling.
_PALETTE = [("#4e79a7", "#d6e4f2"), ("#f28e2b", "#fde3c8"), ("#59a14f", "#d8ecd3"),
            ("#b07aa1", "#eddde8"), ("#76b7b2", "#d9eeec"), ("#edc948", "#fbf1c8"),
            ("#e15759", "#f9d5d5"), ("#9c755f", "#e8ddd6"), ("#ff9da7", "#ffe6e9"),
            ("#bab0ac", "#ebe7e6")]
_BOUNDARY = 'color="#d62728", penwidth=2.2, fontcolor="#d62728"'
_SKIP = 'color="#7b3fa0", penwidth=2.2, style=dashed, fontcolor="#7b3fa0"'
_PARAM = 'color="#999999", style=dotted'


def _q(text: str) -> str:
    """Quote a string for DOT."""
    return '"' + str(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _what(node: torch.fx.Node, gm: torch.fx.GraphModule) -> str:
    """Describe what a node does in a few characters: a module class, function or method."""
    if node.op == "call_module":
        try:
            return type(gm.get_submodule(cast(str, node.target))).__name__
        except AttributeError:
            return str(node.target)
    if node.op == "call_function":
        return getattr(node.target, "__name__", str(node.target))
    if node.op == "call_method":
        return f".{node.target}()"
    if node.op == "get_attr":
        return f"get_attr {node.target}"
    return node.op


def _shape(node: torch.fx.Node) -> str:
    """Return a node's tensor shape as 8x16x32x32, or '' for other values."""
    spec = node.meta.get("fxpipe.value")
    shape = getattr(spec, "shape", None)
    return "x".join(str(d) for d in shape) if shape is not None else ""


def to_dot(gm: torch.fx.GraphModule, plan: PipelinePlan, *, micro_batches: int | None = None,
           title: str | None = None) -> str:
    """Return DOT source for ``gm`` (with ``fxpipe.stage`` meta) partitioned as in ``plan``.

    ``micro_batches`` divides the byte labels (default: ``plan.chunks``).
    """
    micro = max(micro_batches or plan.chunks, 1)
    stage = {n: n.meta.get("fxpipe.stage", 0) for n in gm.graph.nodes}
    lines = [
        "digraph fxpipe {",
        ("  graph [rankdir=TB, fontname=Helvetica, fontsize=12, labelloc=t, newrank=true, "
         "ranksep=0.22, nodesep=0.25, "
         f"label={_q((title or 'pipeline') + f': {plan.n_stages} stages')}];"),
        ('  node [shape=box, style="rounded,filled", fontname=Helvetica, fontsize=9, color="#555555", '
         'height=0.3, margin="0.08,0.03"];'),
        '  edge [color="#777777", arrowsize=0.6, fontname=Helvetica, fontsize=9];',
    ]
    for s in plan.stages:
        border, fill = _PALETTE[s.index % len(_PALETTE)]
        label = (f"stage {s.index} ({s.device}): {human(s.flops)} FLOPs, "
                 f"{human(s.params, 'B')} params")
        lines += [f"  subgraph cluster_{s.index} {{",
                  f'    label={_q(label)}; style="rounded"; color="{border}"; penwidth=2; fontcolor="{border}";']
        for node in gm.graph.nodes:
            if stage[node] != s.index:
                continue
            what = _what(node, gm)
            first = node.name if what == node.op or node.name.startswith(what) else f"{node.name}: {what}"
            text = "\n".join(t for t in (first, _shape(node)) if t)
            shape = ', shape=note' if node.op == "get_attr" else (
                ', shape=oval' if node.op in ("placeholder", "output") else "")
            lines.append(f'    {_q(node.name)} [label={_q(text)}, fillcolor="{fill}"{shape}];')
        lines.append("  }")
    for node in gm.graph.nodes:
        for user in node.users:
            a, b = stage[node], stage[user]
            attrs = ""
            if node.op == "get_attr":
                attrs = _PARAM if b != a else ""
            elif b == a + 1:
                attrs = f"{_BOUNDARY}, label={_q(human(node.meta.get('fxpipe.bytes', 0) // micro, 'B'))}"
            elif b > a + 1:
                size = human(node.meta.get("fxpipe.bytes", 0) // micro, "B")
                attrs = f"{_SKIP}, label={_q(f'skip {a}->{b} {size}')}"
            lines.append(f"  {_q(node.name)} -> {_q(user.name)}" + (f" [{attrs}]" if attrs else "") + ";")
    lines.append("}")
    return "\n".join(lines) + "\n"


def graphviz_available() -> bool:
    """Tell whether Graphviz's ``dot`` program is on the PATH."""
    return shutil.which("dot") is not None


def render(source: str, path: str, fmt: str | None = None, *, timeout: float = 300) -> None:
    """Render DOT ``source`` to ``path`` (svg, png, pdf...) with Graphviz's ``dot``.

    Raises FileNotFoundError if ``dot`` is not installed, RuntimeError if it fails.
    """
    exe = shutil.which("dot")
    if exe is None:
        raise FileNotFoundError("Graphviz's `dot` is not installed (Debian/Ubuntu: apt install graphviz; "
                                "macOS: brew install graphviz)")
    fmt = fmt or path.rsplit(".", 1)[-1]
    done = subprocess.run([exe, f"-T{fmt}", "-o", path], input=source.encode(), capture_output=True,
                          timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"dot -T{fmt} failed: {done.stderr.decode(errors='replace').strip()}")
