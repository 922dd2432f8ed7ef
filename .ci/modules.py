#!/usr/bin/env python
"""Print every package and module of fxpipe with the first line of its docstring.

docs/architecture.md shows this output as a generated block (.ci/docblocks.py), so the list
of modules is never kept by hand. Reads the sources with ``ast``; imports nothing.

    python .ci/modules.py
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOPS = ("passes", "fxpipe")  # passes/ is installed as fxpipe.passes


def first_line(path: Path) -> str:
    """Return the first line of a module's docstring, or a note that it has none."""
    doc = ast.get_docstring(ast.parse(path.read_text()))
    return doc.strip().split("\n")[0].strip() if doc else "(no docstring)"


def main() -> None:
    """Print a row per package and module."""
    rows: list[tuple[str, str]] = []
    for top in TOPS:
        for init in sorted((ROOT / top).rglob("__init__.py")):
            package = init.parent
            if any(part.startswith((".", "_")) or part.endswith(".egg-info") for part in
                   package.relative_to(ROOT).parts):
                continue
            rows.append((f"{package.relative_to(ROOT)}/", first_line(init)))
            for module in sorted(package.glob("*.py")):
                if module.name != "__init__.py":
                    rows.append((f"  {module.name}", first_line(module)))
    width = max(len(name) for name, _ in rows) + 2
    for name, doc in rows:
        print(f"{name:<{width}}{doc}")


if __name__ == "__main__":
    main()
