"""README.md names the two commands a newcomer needs, and CI runs the test one."""

from __future__ import annotations

from docs_support import README, ROOT


def test_readme_names_the_two_commands_and_ci_calls_the_test_one() -> None:
    text = README.read_text()
    assert "scripts/demo" in text
    assert "scripts/test" in text
    assert "scripts/test" in (ROOT / ".ci" / "run").read_text()
