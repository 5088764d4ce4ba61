"""The demo's ``--xds`` stack: the sidecars take their limits from the project's control plane
(``stack.xds_server``) serving a copy of the config directory, and an edit there reaches every
sidecar, seen through every Envoy."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from stack.demo import describe_stack, parse_arguments
from stack.topology import StackOptions, running_stack
from tests.support.envoys import fresh_window, send, wait_for

pytestmark = [pytest.mark.envoy, pytest.mark.slow]

PER_KEY = "name: per_api_key\n          unit: minute\n          requests_per_unit: {}\n"
"""The demo config's per-API-key limit (examples/config/demo.yaml), by its requests per minute."""


def admitted(url: str, tries: int) -> int:
    """200s for ``tries`` requests of a new API key through one Envoy."""
    key = {"x-api-key": f"k{time.time_ns()}"}
    return sum(send(url, "/api/items", key).status == 200 for _ in range(tries))


def acks_of_a_new_snapshot(events: list[dict[str, Any]]) -> int:
    """Acks of the latest snapshot the server published after the one it started with."""
    published = [event["version"] for event in events if event["event"] == "snapshot"]
    if not published:
        return 0
    return sum(event["event"] == "ack" and event["version"] == published[-1] for event in events)


def test_the_demo_option_turns_the_control_plane_on() -> None:
    assert parse_arguments(["--xds"]).xds is True
    assert parse_arguments([]).xds is False


@pytest.mark.alone  # exact 200 counts through Envoy's shipped 25 ms filter timeout: a loaded machine fails open
def test_an_edit_on_the_control_plane_reaches_every_sidecar(tmp_path: Path) -> None:
    options = StackOptions(replicas=2, use_redis=False, xds=True)
    with running_stack(tmp_path, options) as stack:
        assert stack.xds is not None and stack.xds_limits is not None
        assert any("xds-server" in line and "edit a file there" in line for line in describe_stack(stack))
        served = stack.xds_limits / "demo.yaml"
        text = served.read_text()
        assert PER_KEY.format(10) in text
        fresh_window(60, needed=20)
        # 10 per minute on the embedded backend with --instances 2: 5 per sidecar.
        assert [admitted(url, 7) for url in stack.envoy_urls] == [5, 5]

        # As an editor saves: a new file renamed over the old (a file written in place can be
        # polled while empty). Then both sidecars must have acknowledged the edited snapshot:
        # a count taken earlier can be met by other rules of the route (a loaded CI did).
        edited = served.with_name(".demo.yaml.new")
        edited.write_text(text.replace(PER_KEY.format(10), PER_KEY.format(2)))
        edited.replace(served)
        xds = stack.xds
        wait_for(lambda: acks_of_a_new_snapshot(xds.events()) >= 2, 30, "both sidecars acking the edit")
        fresh_window(60, needed=10)
        assert [admitted(url, 3) for url in stack.envoy_urls] == [1, 1]
        events = [event["event"] for event in stack.xds.events()]
        assert events.count("nack") == 0 and events.count("ack") >= 4, events
