"""Check fxpipe's import graph: every import points down the layers, and no modules import each other in a circle.

    python .ci/imports.py          # exit 1 naming each import against the rule, and each circle
    python .ci/imports.py --layers # print the layers, from the bottom (docs/architecture.md)

The layers, from the bottom (a module may import its own layer and the layers below it; two
layers of one rank may not import each other; imports under ``if TYPE_CHECKING:`` are for
annotations only and not counted):

    0   fxpipe.passes                         pure graph passes (the top-level passes/ folder)
    1   fxpipe.errors, fxpipe.options,        what can go wrong; what compile accepts
        fxpipe.torchcompile, fxpipe.unknownargs
    2   fxpipe.frontend                       a model becomes a GraphModule
    3   fxpipe.plan                           the GraphModule becomes stages and a PipelinePlan
    4   fxpipe.runtime.schedules,             the runtime's data: action lists, and what a run
        fxpipe.runtime.observe                records (the simulator reads both)
    5   fxpipe.materialize | fxpipe.simulate  tensors filled where owned | a plan predicted
    6.0 fxpipe.runtime.{microbatch, targetgrads, binding, validate, placement}   the runtime's basics
    6.1 fxpipe.runtime.stage                  one stage on one micro-batch
    6.2 fxpipe.runtime.transport              values between stages and ranks
    6.3 fxpipe.runtime                        target, build, local, distributed, interpreter, contract
    7   fxpipe.pipe                           the Pipe users hold
    8   fxpipe.checkpoint | fxpipe.training   save/load | clipping and scaling across ranks
    9   fxpipe.compiler                       fxpipe.compile: options -> front end -> plan -> build
    10  fxpipe.tools | fxpipe.compat          the CLI | the torchgpipe drop-in (both call compile)
    11  fxpipe.testing                        equality with eager (calls compile and the tools)
    12  fxpipe                                its __init__ (the public API) and __main__
"""

from __future__ import annotations

import ast
import os
import sys
from collections.abc import Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LAYERS = [  # (rank, name, the packages and modules in it)
    (0, "passes", ["fxpipe.passes"]),
    (1, "vocabulary", ["fxpipe.errors", "fxpipe.options", "fxpipe.torchcompile",
                          "fxpipe.unknownargs"]),
    (2, "frontend", ["fxpipe.frontend"]),
    (3, "plan", ["fxpipe.plan"]),
    (4, "runtime data", ["fxpipe.runtime.schedules", "fxpipe.runtime.observe"]),
    (5, "materialize", ["fxpipe.materialize"]),
    (5, "simulate", ["fxpipe.simulate"]),
    (6.0, "runtime basics", ["fxpipe.runtime.microbatch", "fxpipe.runtime.targetgrads", "fxpipe.runtime.binding", "fxpipe.runtime.validate",
                             "fxpipe.runtime.placement"]),
    (6.1, "runtime.stage", ["fxpipe.runtime.stage"]),
    (6.2, "runtime.transport", ["fxpipe.runtime.transport"]),
    (6.3, "runtime", ["fxpipe.runtime"]),
    (7, "pipe", ["fxpipe.pipe"]),
    (8, "checkpoint", ["fxpipe.checkpoint"]),
    (8, "training", ["fxpipe.training"]),
    (9, "compiler", ["fxpipe.compiler"]),
    (10, "tools", ["fxpipe.tools"]),
    (10, "compat", ["fxpipe.compat"]),
    (11, "testing", ["fxpipe.testing"]),
    (12, "fxpipe", ["fxpipe"]),
]
RANKS = {name: rank for rank, name, _ in LAYERS}
KEYS = {key: name for _, name, keys in LAYERS for key in keys}


def modules() -> Iterator[tuple[str, str]]:
    """Yield (module name, file path) for every module of the installed package."""
    for base, package in ((os.path.join(ROOT, "fxpipe"), "fxpipe"), (os.path.join(ROOT, "passes"), "fxpipe.passes")):
        for folder, _, files in os.walk(base):
            for name in sorted(files):
                if name.endswith(".py"):
                    rel = os.path.relpath(os.path.join(folder, name), base)[:-3].replace(os.sep, ".")
                    mod = package if rel == "__init__" else f"{package}.{rel.removesuffix('.__init__')}"
                    yield mod, os.path.join(folder, name)


def layer(module: str) -> str:
    """Return the name of the layer a module belongs to (its longest listed prefix's)."""
    return KEYS[max((k for k in KEYS if module == k or module.startswith(k + ".")), key=len)]


def imports(module: str, path: str, known: set[str]) -> Iterator[tuple[str, int]]:
    """Yield (imported fxpipe module, line) for every import of ``path`` outside ``if TYPE_CHECKING:``."""
    tree = ast.parse(open(path).read(), path)
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING"
                   for n in ast.walk(node)}
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("fxpipe"):
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if not base.startswith("fxpipe"):
                continue
            for alias in node.names:  # `from fxpipe.x import y`: y may be a module
                full = f"{base}.{alias.name}"
                yield (full if full in known else base), node.lineno


def table() -> str:
    """Return the layers as text, from the bottom: rank, name, packages and modules."""
    return "\n".join(f"{rank:<5g}{name:<19}{', '.join(keys)}" for rank, name, keys in LAYERS)


def main() -> int:
    """Print every import against the layers and every circle; return the exit status."""
    if "--layers" in sys.argv[1:]:
        print(table())
        return 0
    found = dict(modules())
    known = set(found)
    graph: dict[str, set[str]] = {m: set() for m in found}
    bad = []
    for mod, path in found.items():
        for target, line in imports(mod, path, known):
            if target not in known:
                continue
            graph[mod].add(target)
            a, b = layer(mod), layer(target)
            if a != b and RANKS[b] >= RANKS[a]:
                bad.append(f"{os.path.relpath(path, ROOT)}:{line}: {mod} ({a}, rank {RANKS[a]}) imports "
                           f"{target} ({b}, rank {RANKS[b]})")
    circles = _circles(graph)
    for line in bad:
        print(line)
    for circle in circles:
        print("circle: " + " -> ".join(circle + circle[:1]))
    print(f"{len(known)} modules, {sum(map(len, graph.values()))} imports: "
          f"{len(bad)} against the layers, {len(circles)} circle(s)")
    return 1 if bad or circles else 0


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Return the strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                out.append(sorted(part))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


if __name__ == "__main__":
    sys.exit(main())
