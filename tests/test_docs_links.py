"""The documentation stays navigable and self-contained: every relative link in the repository's Markdown
resolves to a file (and, for ``file.md#anchor``, to a heading of that file) inside the repository, and no
file names a path outside it (a sibling checkout beside this one is not there for a reader of a fresh
clone).

Only what a reader follows is checked: links and images (``[text](target)``, ``[id]: target``) outside
code. Absolute URLs (``https:``, ``mailto:``) are left alone. Anchors are GitHub's: a heading's text,
lowercased, punctuation dropped, spaces as hyphens, ``-1``, ``-2`` ... for repeats.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from support import ROOT

SKIP_DIRS = {".git", ".venv", "node_modules", "__pycache__", ".pytest_cache", ".hypothesis", "build", "dist"}
TEXT_SUFFIXES = {".md", ".py", ".yaml", ".yml", ".toml", ".cfg", ".ini", ".sh", ".json", ".txt"}
# A path that leaves the repository from its root: built so that this file does not name one itself.
OUTSIDE = re.compile(re.escape("..") + r"/shared\b")

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.MULTILINE)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.MULTILINE)
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")


def _files(suffixes: set[str]) -> list[Path]:
    found = []
    for directory, subdirs, names in os.walk(ROOT):
        subdirs[:] = sorted(d for d in subdirs if d not in SKIP_DIRS and not d.startswith("."))
        found += [Path(directory) / n for n in sorted(names) if Path(n).suffix in suffixes or n == "Makefile"]
    return found


def _prose(text: str) -> str:
    """The text a reader sees as prose: fenced blocks and code spans blanked out."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings (and its explicit HTML anchors)."""
    seen: dict[str, int] = {}
    found = set(HTML_ANCHOR.findall(text))
    for heading in HEADING.findall(FENCE.sub("", text)):
        heading = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
        slug = re.sub(r"[^\w\- ]", "", heading.replace("`", "").lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def links(text: str) -> list[str]:
    prose = _prose(text)
    return INLINE_LINK.findall(prose) + REFERENCE_LINK.findall(prose)


def broken(source: Path, target: str) -> str | None:
    """Why ``target``, a link in ``source``, does not resolve inside the repository (None when it does)."""
    if SCHEME.match(target):
        return None
    path, _, fragment = target.partition("#")
    resolved = (source.parent / path).resolve() if path else source.resolve()
    if not resolved.is_relative_to(ROOT.resolve()):
        return "points outside the repository"
    if not resolved.exists():
        return "no such file"
    if fragment and resolved.suffix == ".md" and fragment not in anchors(resolved.read_text()):
        return f"no heading with anchor #{fragment}"
    return None


MARKDOWN = _files({".md"})


def test_the_docs_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in MARKDOWN}
    assert {"README.md", "docs/benchmarks.md"} <= names


@pytest.mark.parametrize("source", MARKDOWN, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves_inside_the_repository(source: Path):
    problems = [f"{target}: {why}" for target in links(source.read_text()) if (why := broken(source, target))]
    assert not problems, f"{source.relative_to(ROOT)}: " + "; ".join(problems)


def test_no_file_names_a_path_outside_the_repository():
    offenders = []
    for path in _files(TEXT_SUFFIXES):
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        offenders += [f"{path.relative_to(ROOT)}:{n}" for n, line in enumerate(text.splitlines(), 1)
                      if OUTSIDE.search(line)]
    assert not offenders, "paths outside the repository (point to docs/ instead): " + ", ".join(offenders)


def test_the_checker_catches_what_it_is_for(tmp_path: Path):
    """The rules themselves: an anchor as GitHub spells it, a missing file, a link out of the repository,
    code that is not a link."""
    text = "# Guard cost: side by side (`bench/guard_ab.py`, issue 28)\n## Again\n## Again\n"
    assert anchors(text) >= {"guard-cost-side-by-side-benchguard_abpy-issue-28", "again", "again-1"}
    assert links("see [a](x.md#y) and `[b](z.md)`\n```\n[c](w.md)\n```\n[d]: e.md\n") == ["x.md#y", "e.md"]
    doc = ROOT / "README.md"
    assert broken(doc, "docs/benchmarks.md") is None
    assert broken(doc, "https://example.com/x") is None
    assert broken(doc, "docs/no-such-page.md") == "no such file"
    assert broken(doc, "../" + "outside.md") == "points outside the repository"
    assert broken(doc, "docs/benchmarks.md#no-such-heading") == "no heading with anchor #no-such-heading"
