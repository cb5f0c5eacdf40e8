"""Check the relative links of README.md, docs/*.md and docs/measurements/*/README.md.

Usage: python tests/doc_links.py [FILE.md ...]   (default: those files; exit code 1 on a broken link);
tests/test_house.py runs it in the suite.

A link ``[text](target)`` whose target is not a URL must name an existing file or folder, relative to the
Markdown file; a ``#anchor`` (alone, or after a ``.md`` target) must be the GitHub slug of a heading of that file.
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (word characters, spaces, hyphens kept),
    spaces turned into hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def prose_lines(path: Path) -> list[str]:
    """The file's lines outside fenced code blocks."""
    out, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return out


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in prose_lines(path):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        s = slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        found.add(s if n == 0 else f"{s}-{n}")
    return found


def broken_links(path: Path) -> list[str]:
    problems, name = [], os.path.relpath(path, ROOT)
    for number, line in enumerate(prose_lines(path), 1):
        for target in LINK.findall(line):
            if re.match(r"^[a-z]+:", target):        # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                problems.append(f"{name}: {target}: no such file")
                continue
            if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{name}: {target}: no heading with that anchor")
    return problems


def main(argv: list[str]) -> int:
    files = [Path(a).resolve() for a in argv] or [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
                                                   *sorted((ROOT / "docs" / "measurements").glob("*/README.md"))]
    problems = [p for f in files for p in broken_links(f)]
    print("\n".join(problems) if problems else f"{len(files)} files, every relative link resolves")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
