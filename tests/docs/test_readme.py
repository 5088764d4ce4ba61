"""README.md is the front door: short, names the two commands, and maps every page of docs/."""

from __future__ import annotations

import re

from tests.docs.docs_support import DOCS, README, ROOT, section

MAX_README_LINES = 300
DOCS_MAP = "The docs"
"""The README heading whose section links every docs/ page, one line each."""


def test_readme_names_the_two_commands_and_ci_calls_the_test_one() -> None:
    text = README.read_text()
    assert "scripts/demo" in text
    assert "scripts/test" in text
    assert "scripts/test" in (ROOT / ".ci" / "run").read_text()


def test_readme_is_at_most_300_lines() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; move detail into docs/"


def test_every_docs_page_is_linked_from_the_readme_docs_map() -> None:
    docs_map = section(README.read_text(), DOCS_MAP)
    for page in sorted(DOCS.glob("*.md")):
        target = f"docs/{page.name}"
        lines = [line for line in docs_map if re.search(rf"\]\({re.escape(target)}(#[^)]*)?\)", line)]
        assert len(lines) == 1, f"README's '{DOCS_MAP}' should link {target} on exactly one line, found {len(lines)}"
