"""Rewrite the generated parts of README.md (the settings table) from the code.

tests/unit/test_readme.py fails when README.md and the code disagree; run
``.venv/bin/python scripts/update_readme.py`` after changing a setting.
"""

from __future__ import annotations

import re
from pathlib import Path

from sidecar.settings import reference_table

README = Path(__file__).resolve().parent.parent / "README.md"
START, END = "<!-- settings-table:start -->", "<!-- settings-table:end -->"


def with_settings_table(text: str) -> str:
    """README text with the block between the settings markers regenerated."""
    pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.DOTALL)
    return pattern.sub(lambda _: f"{START}\n{reference_table()}\n{END}", text)


if __name__ == "__main__":
    README.write_text(with_settings_table(README.read_text()))
