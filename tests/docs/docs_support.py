"""What the documentation tests read from Markdown: links outside code, and heading anchors."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"`+[^`]*`+")
_INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)


def pages() -> list[Path]:
    """README.md and every docs/*.md page."""
    return [README, *sorted(DOCS.glob("*.md"))]


def prose_lines(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` outside fenced code blocks, with inline code removed."""
    lines: list[tuple[int, str]] = []
    fenced = False
    for number, line in enumerate(text.splitlines(), start=1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, _INLINE_CODE.sub("", line)))
    return lines


def links(text: str) -> list[tuple[int, str]]:
    """``(line number, target)`` of every inline, image and reference link outside code."""
    found: list[tuple[int, str]] = []
    for number, line in prose_lines(text):
        found += [(number, target) for target in _INLINE_LINK.findall(line)]
        reference = _REFERENCE.match(line)
        if reference:
            found.append((number, reference.group(1)))
    return found


def is_relative(target: str) -> bool:
    """A link into this repository (not a URL, not a mail address)."""
    return not _EXTERNAL.match(target)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a page, numbered as GitHub numbers repeated headings."""
    seen: dict[str, int] = {}
    result: set[str] = set()
    fenced = False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        heading = None if fenced else _HEADING.match(line)
        if heading:
            base = slug(heading.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            result.add(base if count == 0 else f"{base}-{count}")
    return result


def section(text: str, title: str) -> list[str]:
    """The lines under the heading ``title`` (any level) up to the next heading of that level or higher."""
    lines: list[str] = []
    level = 0
    fenced = False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
        heading = None if fenced else _HEADING.match(line)
        if level and heading and len(heading.group(1)) <= level:
            break
        if level:
            lines.append(line)
        elif heading and heading.group(2) == title:
            level = len(heading.group(1))
    if not level:
        raise AssertionError(f"no heading {title!r}")
    return lines
