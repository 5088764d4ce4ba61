"""README.md stays true to the code: its settings table is generated from it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_readme_settings_table_matches_the_code() -> None:
    spec = importlib.util.spec_from_file_location("update_readme", ROOT / "scripts" / "update_readme.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = (ROOT / "README.md").read_text()
    assert module.with_settings_table(text) == text, "run: .venv/bin/python scripts/update_readme.py"


def test_readme_names_the_two_commands_and_ci_calls_the_test_one() -> None:
    text = (ROOT / "README.md").read_text()
    assert "scripts/demo" in text
    assert "scripts/test" in text
    assert "scripts/test" in (ROOT / ".ci" / "run").read_text()
