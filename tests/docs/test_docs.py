"""The documentation stays true to the repository: generated tables and links."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from tests.docs.docs_support import DOCS, ROOT, anchors, is_relative, links, pages


def update_docs() -> ModuleType:
    spec = importlib.util.spec_from_file_location("update_docs", ROOT / "scripts" / "update_docs.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_settings_table_matches_the_code() -> None:
    module = update_docs()
    page = DOCS / "configuration.md"
    assert page == module.CONFIGURATION
    text = page.read_text()
    assert module.START in text and module.END in text, f"{page.name}: the settings-table markers are missing"
    assert module.with_settings_table(text) == text, "run: .venv/bin/python scripts/update_docs.py"


@pytest.mark.parametrize("page", pages(), ids=lambda page: str(page.relative_to(ROOT)))
def test_relative_links_point_to_existing_files_and_headings(page: Path) -> None:
    text = page.read_text()
    broken: list[str] = []
    for line, target in links(text):
        if not is_relative(target):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"line {line}: {target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked.read_text()):
            broken.append(f"line {line}: {target} (no such heading)")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)
