#!/usr/bin/env python
"""Check that every relative link in the docs resolves.

Looks at README.md, benchmarks/README.md and docs/**/*.md (or the files given). For each
markdown link or image ``[text](target)``, reference definition ``[label]: target`` and HTML
``href=``/``src=`` outside code, a relative ``target`` must name an existing file or
directory (relative to the linking file; a leading ``/`` means the repository root), and a
``#anchor`` must name a heading of the target markdown file (GitHub's slugs) or an explicit
``<a id=...>``/``<a name=...>`` in it. Links with a scheme (``https:``, ``mailto:``) are not
fetched.

    python .ci/links.py              # exit 1 listing the broken links
"""

from __future__ import annotations

import re
import sys
import unicodedata
from pathlib import Path
from urllib.parse import unquote

from mdfiles import ROOT, markdown_files

FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^()\s]*(?:\([^()\s]*\)[^()\s]*)*)(?:\s+[\"'(].*?[\"')])?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
HTML = re.compile(r"""\b(?:href|src)\s*=\s*["']([^"']+)["']""")
ANCHOR = re.compile(r"""<a\s[^>]*\b(?:id|name)\s*=\s*["']([^"']+)["']""")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def prose_lines(text: str, keep_code: bool = False) -> list[tuple[int, str]]:
    """Return (line number, line) for every line outside fenced code, inline code removed unless ``keep_code``."""
    out, fence = [], None
    for number, line in enumerate(text.split("\n"), 1):
        m = FENCE.match(line)
        if fence is not None:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence):
                fence = None
            continue
        if m:
            fence = m.group(1)
            continue
        out.append((number, line if keep_code else INLINE_CODE.sub("", line)))
    return out


def slug(heading: str) -> str:
    """Return GitHub's anchor for a heading's text (markdown syntax removed first)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)   # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)                          # inline HTML
    text = text.replace("`", "").replace("*", "")
    text = text.strip().lower()
    kept = []
    for ch in text:
        if ch in " -_" or unicodedata.category(ch)[0] in "LN":
            kept.append(ch)
    return "".join(kept).replace(" ", "-")


def anchors(path: Path, cache: dict[Path, set[str]]) -> set[str]:
    """Return every anchor of a markdown file: heading slugs (numbered when repeated) and <a id>s."""
    if path not in cache:
        seen: dict[str, int] = {}
        found: set[str] = set()
        for _, line in prose_lines(path.read_text(), keep_code=True):
            for name in ANCHOR.findall(line):
                found.add(name)
            m = HEADING.match(line)
            if m:
                base = slug(m.group(2))
                n = seen.get(base, 0)
                seen[base] = n + 1
                found.add(base if n == 0 else f"{base}-{n}")
        cache[path] = found
    return cache[path]


def targets(line: str) -> list[str]:
    """Return the link targets on one line of prose."""
    found = [t[1:-1] if t.startswith("<") else t for t in LINK.findall(line)]
    m = REFERENCE.match(line)
    if m:
        t = m.group(1)
        found.append(t[1:-1] if t.startswith("<") else t)
    found += HTML.findall(line)
    return found


def check(path: Path, cache: dict[Path, set[str]]) -> list[str]:
    """Return a line per broken link in ``path``."""
    broken = []
    rel = path.relative_to(ROOT)
    for number, line in prose_lines(path.read_text()):
        for target in targets(line):
            if not target or SCHEME.match(target) or target.startswith("//"):
                continue
            file_part, _, anchor = target.partition("#")
            file_part = unquote(file_part)
            if file_part:
                dest = (ROOT / file_part.lstrip("/")) if file_part.startswith("/") else (path.parent / file_part)
                dest = dest.resolve()
                if not dest.exists():
                    broken.append(f"{rel}:{number}: {target} (no such file: {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest})")
                    continue
            else:
                dest = path
            if anchor:
                if dest.is_dir() or dest.suffix.lower() != ".md":
                    broken.append(f"{rel}:{number}: {target} (an anchor into a file that is not markdown)")
                elif unquote(anchor) not in anchors(dest, cache):
                    broken.append(f"{rel}:{number}: {target} (no heading '#{anchor}' in {dest.relative_to(ROOT)})")
    return broken


def main() -> int:
    """Check every file; print the broken links; return the exit status."""
    files = [Path(f).resolve() for f in sys.argv[1:]] or markdown_files()
    cache: dict[Path, set[str]] = {}
    broken, count = [], 0
    for path in files:
        count += 1
        broken += check(path, cache)
    if broken:
        print(f"{len(broken)} broken link(s):")
        print("\n".join(f"  {b}" for b in broken))
        return 1
    print(f"links: {count} files checked, every relative link resolves")
    return 0


if __name__ == "__main__":
    sys.exit(main())
