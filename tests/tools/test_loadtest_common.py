"""The helpers that several load-test tools share (loadtest/common.py)."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.common import floor_percentile, scrape_metrics

METRICS = b"""# HELP x_total calls
# TYPE x_total counter
x_total 7
y_seconds_bucket{le="0.005"} 3.0
y_seconds_bucket{le="+Inf"} 4
garbage line here
"""


class _Metrics(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = METRICS if self.path == "/metrics" else b""
        self.send_response(200 if body else 404)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def metrics_url() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_floor_percentile_takes_the_sample_at_the_floor_index() -> None:
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert floor_percentile(values, 0.5) == 3.0
    assert floor_percentile(values, 0.99) == 5.0  # floor(4.95) = index 4
    assert floor_percentile(values, 0.2) == 2.0  # floor(1.0) = index 1, not nearest rank's 1.0
    assert floor_percentile(values, 1.0) == 5.0
    assert floor_percentile([], 0.5) == 0.0


def test_scrape_metrics_reads_samples_and_skips_comments(metrics_url: str) -> None:
    samples = scrape_metrics(metrics_url, timeout=5)
    assert samples == {"x_total": 7.0, 'y_seconds_bucket{le="0.005"}': 3.0, 'y_seconds_bucket{le="+Inf"}': 4.0}


def test_scrape_metrics_raises_oserror_when_nothing_answers(metrics_url: str) -> None:
    with pytest.raises(OSError):
        scrape_metrics(metrics_url + "/nothing", timeout=5)


def test_every_loadtest_module_imports() -> None:
    """A helper moved into loadtest/common.py leaves no module importing a name that is gone."""
    import importlib
    import pkgutil

    import loadtest

    names = [info.name for info in pkgutil.walk_packages(loadtest.__path__, "loadtest.")]
    skipped = {"loadtest.locustfile"}  # locust monkey-patches on import (gevent); its own test runs it
    for name in names:
        if name not in skipped and not name.endswith("__main__"):
            importlib.import_module(name)
    assert "loadtest.reliability_harness.loop_stalls" in names


def python_lines(root: Path, skip: str | None = None) -> dict[Path, int]:
    """Lines per ``.py`` file under ``root`` (``skip``: a sub-folder left out)."""
    return {
        path: len(path.read_text(encoding="utf-8").splitlines())
        for path in root.rglob("*.py")
        if skip is None or skip not in path.relative_to(root).parts
    }


def test_loadtest_stays_within_its_line_budget() -> None:
    """docs/performance.md's budget: the benchmarks stay smaller than the product they
    measure (sidecar/ without its generated protos), and no module has over 600 lines."""
    repo = Path(__file__).resolve().parents[2]
    tools = python_lines(repo / "loadtest")
    product = python_lines(repo / "sidecar", skip="protos")
    assert sum(tools.values()) < sum(product.values()), (sum(tools.values()), sum(product.values()))
    too_long = {str(path.relative_to(repo)): lines for path, lines in tools.items() if lines > 600}
    assert too_long == {}
