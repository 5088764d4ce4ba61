"""Every Python snippet in README.md and docs/*.md runs as written.

A reader copies a snippet into a file and runs it, so each ```python block is run the same
way, in a fresh interpreter. The HTML comment right above a block says what it needs:

- ``<!-- snippet: runs against `ratelimit-sidecar serve --config DIR` -->``: the test starts
  that sidecar and the snippet's ``127.0.0.1:8081`` (the default address) is pointed at it,
  the one change made to the text;
- ``<!-- snippet: not runnable: WHY -->``: skipped with that reason (keep these rare).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from stack.sidecar import SidecarProcess
from tests.docs.docs_support import ROOT, pages

DEFAULT_ADDRESS = "127.0.0.1:8081"
_MARK = re.compile(r"<!--\s*snippet:\s*(.*?)\s*-->")
_NEEDS_SIDECAR = re.compile(r"runs against `ratelimit-sidecar serve --config (\S+)`")
_NOT_RUNNABLE = re.compile(r"not runnable:\s*(.+)")


@dataclass(frozen=True)
class Snippet:
    page: Path
    line: int
    code: str
    mark: str
    """The ``snippet:`` comment above the block, or empty."""

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def snippets(page: Path) -> list[Snippet]:
    """The ```python blocks of ``page``, each with the mark on the line above its fence."""
    found: list[Snippet] = []
    lines = page.read_text().splitlines()
    index = 0
    while index < len(lines):
        if lines[index].strip() == "```python":
            end = next(i for i in range(index + 1, len(lines)) if lines[i].strip() == "```")
            mark = _MARK.search(lines[index - 1]) if index else None
            code = "\n".join(lines[index + 1 : end]) + "\n"
            found.append(Snippet(page, index + 1, code, mark.group(1) if mark else ""))
            index = end
        index += 1
    return found


ALL = [snippet for page in pages() for snippet in snippets(page)]


def test_the_docs_have_python_snippets_to_run() -> None:
    assert ALL, "no ```python block found: the collector is broken"


def test_every_mark_is_one_the_runner_knows() -> None:
    unknown = [s.where for s in ALL if s.mark and not (_NEEDS_SIDECAR.match(s.mark) or _NOT_RUNNABLE.match(s.mark))]
    assert unknown == []


@pytest.mark.slow
@pytest.mark.parametrize("snippet", ALL, ids=[snippet.where for snippet in ALL])
def test_the_snippet_runs_as_written(snippet: Snippet, tmp_path: Path) -> None:
    skipped = _NOT_RUNNABLE.match(snippet.mark)
    if skipped:
        pytest.skip(f"{snippet.where} is marked not runnable: {skipped.group(1)}")
    code = snippet.code
    sidecar = None
    needs = _NEEDS_SIDECAR.match(snippet.mark)
    if needs:
        config = ROOT / needs.group(1)
        assert config.exists(), f"{snippet.where}: no {needs.group(1)}"
        sidecar = SidecarProcess("snippet-sidecar", ["--config", str(config)], tmp_path)
        code = code.replace(DEFAULT_ADDRESS, sidecar.address)
    (tmp_path / "snippet.py").write_text(code)
    try:
        if sidecar is not None:
            sidecar.start()
            sidecar.wait_ready()
        result = subprocess.run(
            [sys.executable, "snippet.py"],
            cwd=tmp_path,
            env={key: value for key, value in os.environ.items() if not key.startswith("RLS_")},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        if sidecar is not None:
            sidecar.stop()
    assert result.returncode == 0, f"{snippet.where} failed:\n{result.stderr[-3000:]}"
