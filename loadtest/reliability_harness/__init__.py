"""Pieces of ``loadtest/reliability.py``: one module per area, each returning report rows.

Every scenario module exposes ``run(context: Context) -> list[Row]``: it starts what it
needs (through the ``stack`` package: real sidecars, redis-server), bounded in time and
count, stops everything it started, and reports one row per scenario. A scenario that
cannot run on this machine says so in a row with ``ok=None``; a failure is a row with
``ok=False`` and the reason in ``notes``, never an exception escaping ``run`` (the report
must show every area).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Context:
    """What every scenario gets: where to put files, how long it may take."""

    directory: Path
    """A fresh directory for logs, configs and data of this run."""
    quick: bool
    """CI-sized: seconds per scenario instead of minutes."""
    seed: int = 1
    server_cpus: tuple[int, ...] | None = None
    client_cpus: tuple[int, ...] | None = None
    smoke: bool = False
    """Test-sized (tests/tools): smaller than quick where an area has a smoke size of its own (fewer
    seconds, values, rounds), still every code path and every invariant its rows check; the
    report's figures come from quick and full runs, never from this size. Implies ``quick``."""
    flags: frozenset[str] = frozenset()
    """An area's own switches, given on its command line (``--floor`` -> ``"floor"``)."""

    @property
    def size(self) -> str:
        """``smoke``, ``quick`` or ``full``: what an area sizes its run by."""
        return "smoke" if self.smoke else "quick" if self.quick else "full"


@dataclass
class Row:
    """One line of the report."""

    area: str
    """``bad input``, ``load``, ``faults``, ``clock``, ``security``."""
    scenario: str
    load: str = ""
    """What load it held, e.g. ``2,100 req/s, p99 9.8 ms`` (empty when not a load test)."""
    inputs: int = 0
    """Bad inputs tried (fuzz cases, malformed messages, broken configs)."""
    hits_lost: int | None = None
    """Admitted hits Redis does not hold after recovery (must be 0; the SIGKILL row shows its bound)."""
    ok: bool | None = True
    """True: held; False: failed (see notes); None: not run here (see notes)."""
    notes: str = ""
    goals_missed: list[str] = field(default_factory=list)
    """Latency goals (benchmark figures) this run missed. Reported, never a failure of the row:
    a noisy 2-core machine misses them for reasons of its own, while ``ok`` is what must hold."""
    figures: dict[str, float] = field(default_factory=dict)
    """Numbers behind the row, for the JSON results and the tests."""
