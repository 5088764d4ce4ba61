"""Rewrite the generated parts of the documentation (the settings tables) from the code.

The settings table lives in docs/configuration.md, between the settings-table markers;
the table of envoyproxy/ratelimit's variables in docs/migrating.md, between the
reference-variables markers. tests/docs/test_docs.py fails when a page and the code
disagree; run ``.venv/bin/python scripts/update_docs.py`` after changing a setting.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from sidecar.reference_env import variables_table
from sidecar.settings import reference_table

ROOT = Path(__file__).resolve().parent.parent
CONFIGURATION = ROOT / "docs" / "configuration.md"
START, END = "<!-- settings-table:start -->", "<!-- settings-table:end -->"
MIGRATING = ROOT / "docs" / "migrating.md"
REFERENCE_START, REFERENCE_END = "<!-- reference-variables:start -->", "<!-- reference-variables:end -->"


def with_settings_table(text: str) -> str:
    """Page text with the block between the settings markers regenerated."""
    pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.DOTALL)
    return pattern.sub(lambda _: f"{START}\n{reference_table()}\n{END}", text)


def with_reference_table(text: str) -> str:
    """Page text with the block between the reference-variables markers regenerated."""
    pattern = re.compile(re.escape(REFERENCE_START) + ".*?" + re.escape(REFERENCE_END), re.DOTALL)
    return pattern.sub(lambda _: f"{REFERENCE_START}\n{variables_table()}\n{REFERENCE_END}", text)


def update(path: Path = CONFIGURATION, regenerate: Callable[[str], str] = with_settings_table) -> bool:
    """Regenerate the generated block of ``path``; True when the file changed."""
    text = path.read_text()
    new = regenerate(text)
    if new == text:
        return False
    path.write_text(new)
    return True


if __name__ == "__main__":
    for page, regenerate in ((CONFIGURATION, with_settings_table), (MIGRATING, with_reference_table)):
        print(f"{page.relative_to(ROOT)}: {'updated' if update(page, regenerate) else 'already up to date'}")
