"""The Markdown files the docs checks read: README.md, benchmarks/README.md and docs/."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def markdown_files() -> list[Path]:
    """Return the Markdown files of the project's docs, in a stable order."""
    files = [ROOT / "README.md", ROOT / "benchmarks" / "README.md"]
    files += sorted((ROOT / "docs").rglob("*.md"))
    return [f for f in files if f.is_file()]
