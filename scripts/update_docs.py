"""Rewrite the generated parts of the documentation (the settings table) from the code.

The settings table lives in docs/configuration.md, between the settings-table markers.
tests/docs/test_docs.py fails when that page and the code disagree; run
``.venv/bin/python scripts/update_docs.py`` after changing a setting.
"""

from __future__ import annotations

import re
from pathlib import Path

from sidecar.settings import reference_table

ROOT = Path(__file__).resolve().parent.parent
CONFIGURATION = ROOT / "docs" / "configuration.md"
START, END = "<!-- settings-table:start -->", "<!-- settings-table:end -->"


def with_settings_table(text: str) -> str:
    """Page text with the block between the settings markers regenerated."""
    pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.DOTALL)
    return pattern.sub(lambda _: f"{START}\n{reference_table()}\n{END}", text)


def update(path: Path = CONFIGURATION) -> bool:
    """Regenerate the settings table of ``path``; True when the file changed."""
    text = path.read_text()
    new = with_settings_table(text)
    if new == text:
        return False
    path.write_text(new)
    return True


if __name__ == "__main__":
    print(f"{CONFIGURATION.relative_to(ROOT)}: {'updated' if update() else 'already up to date'}")
