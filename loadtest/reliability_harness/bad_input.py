"""Bad input (design.md section 6): fuzzed requests, raw bytes on the wire, broken configs.

Bounded-time, reproducible versions of ``tests/fuzz`` (seeded ``random``, no Hypothesis),
one row each:

* **request fuzz (in-process)**: random and mutated ``RateLimitRequest`` messages (giant
  and empty strings, any unicode, 0 to 1000 descriptors, overrides with every unit
  number, hits at 0/1/uint32/uint64 bounds) and mutated serialized bytes, through
  ``RateLimitService.ShouldRateLimit`` on the memory backend with a tiny
  ``--max-counters``. Each call must be answered (one status per descriptor, codes
  OK/OVER_LIMIT, numbers within uint32) or refused with INVALID_ARGUMENT exactly when
  it breaks a README request bound; live counters never pass the cap.
* **raw bytes to gRPC**: random bytes, mutated valid requests, invalid UTF-8 in string
  fields, deep unknown groups and a message over the 1 MiB cap, sent with identity
  serializers to a real sidecar process (``examples/config``). Every call gets OK or
  INVALID_ARGUMENT (RESOURCE_EXHAUSTED for the oversized one); the process stays up
  and SERVING, logs no exception, counts no internal error, and its RSS grows by less
  than :data:`RSS_GROWTH_LIMIT`.
* **config fuzz**: every field of two valid configs replaced by every other type,
  line and byte mutations, random documents, binary junk, alias and merge-key bombs,
  deep nesting, huge files, loaded by ``load_config`` in a worker process with a time
  limit per load. Each must be refused with issues naming the file and a line, or be
  accepted and then answer requests built from its own descriptors without INTERNAL.

The inputs live in :mod:`~loadtest.reliability_harness.hostile_requests` and
:mod:`~loadtest.reliability_harness.hostile_configs`, the in-process handler in
:mod:`~loadtest.reliability_harness.in_process`, the invariants in
:mod:`~loadtest.reliability_harness.bounds_oracle`, all shared with the tests; this
module runs them, counts the outcomes and writes the rows.

``python -m loadtest.reliability_harness.bad_input [--full]`` runs it alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import select
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

from loadtest.reliability_harness.bounds_oracle import outcome_problem
from loadtest.reliability_harness.hostile_configs import config_cases, exercise, refusal_problems
from loadtest.reliability_harness.hostile_requests import (
    MAX_MESSAGE_BYTES,
    RSS_GROWTH_LIMIT,
    expected_codes,
    mutate,
    random_edits,
    random_invalid_utf8,
    random_request,
    raw_payloads,
    send_raw,
)
from loadtest.reliability_harness.in_process import (
    EXAMPLES,
    SteppingClock,
    TimeLimitExceeded,
    call,
    fuzz_config,
    make_service,
    time_limit,
)
from loadtest.reliability_harness.support import (
    CHANNEL_OPTIONS,
    LOADTEST,
    METHOD,
    MIB,
    REPO,
    Child,
    Context,
    Row,
    failed_row,
    main,
    proc_status,
    process_group,
    rss,
    scrape,
    start_sidecar,
)

AREA = "bad input"
WARM_UP = 300
"""Inputs a flood sends before the measured ones."""
LOAD_TIMEOUT = 20.0
"""Per config load in the worker: the slowest hostile file (8 MiB) takes a few seconds."""
WORKER_MEMORY = 4 * 1024 * MIB
"""Address-space cap of the config worker: a memory bomb fails there, not on the machine."""


# ---------------------------------------------------------------------------------
# In-process service
# ---------------------------------------------------------------------------------


@dataclass
class Tally:
    """Outcomes of a run and the first few violations, for the row."""

    cases: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    violation_count: int = 0

    def violation(self, text: str) -> None:
        self.violation_count += 1
        if len(self.violations) < 5:
            self.violations.append(text[:300])

    def summary(self) -> str:
        return ", ".join(f"{count:,} {name}" for name, count in self.outcomes.most_common())


def check_call(service: Any, request: Any, tally: Tally, what: str) -> None:
    """One call through the handler; records the outcome and any broken invariant."""
    try:
        response, abort = call(service, request)
    except Exception as error:
        tally.outcomes["exception"] += 1
        tally.violation(f"{what}: {type(error).__name__}: {error}")
        return
    tally.outcomes["answered" if abort is None else abort.code.name] += 1
    problem = outcome_problem(request, response, abort)
    if problem is not None:
        tally.violation(f"{what}: {problem}")


HANG_SECONDS = 20.0
"""A call still running this long after the in-process budget ended is a hang."""


def fuzz_case(rng: random.Random, tally: Tally) -> Any:
    """The next request: random messages half the time, else parsed from mutated bytes or
    from bytes with invalid UTF-8 in a string field (None: not a message)."""
    from sidecar.service.servicer import parse_request

    kind = tally.cases % 4
    if kind in (0, 1):
        return random_request(rng)
    if kind == 2:
        return parse_request(mutate(random_request(rng, wild=False).SerializeToString(), random_edits(rng)))
    request = parse_request(random_invalid_utf8(rng, random_request(rng)) or b"\x0a\x01\xff")
    if request is not None:
        tally.violation("invalid UTF-8 in a string field was parsed")
    return request


def request_fuzz(context: Context) -> Row:
    """Random and mutated requests through the handler, in this process."""
    from sidecar.limiter.counters import MAX_INLINE_CHARS
    from sidecar.metrics import MAX_STAT_KEY_LENGTH

    count, budget = (3_000, 10.0) if context.quick else (60_000, 30.0)
    cap = 16
    rng = random.Random(context.seed)
    clock = SteppingClock()
    service, limiter = make_service(fuzz_config(), max_counters=cap, clock=clock)
    longest_key = 0
    decide = limiter.check

    async def measured(checks: Any, now: float) -> Any:
        """The limiter, noting the longest counter key it is asked to hold."""
        nonlocal longest_key
        longest_key = max([longest_key, *(sum(map(len, check.key[1:])) for check in checks)])
        return await decide(checks, now)

    limiter.check = measured  # type: ignore[method-assign]
    tally = Tally()
    rss_before = rss(os.getpid())
    peak_counters = 0
    started = time.monotonic()
    try:
        with time_limit(budget + HANG_SECONDS, "request fuzz"):
            while tally.cases < count and time.monotonic() - started < budget:
                tally.cases += 1
                clock.now += rng.choice([0.0, 0.0, 0.0, 0.001, 0.5, 1.0, 61.0, 3601.0, 90_000.0])
                check_call(service, fuzz_case(rng, tally), tally, f"case {tally.cases}")
                peak_counters = max(peak_counters, limiter.live_counters)
                if limiter.live_counters > cap:
                    tally.violation(f"case {tally.cases}: {limiter.live_counters} live counters, cap {cap}")
    except TimeLimitExceeded:
        tally.violation(f"case {tally.cases}: still running {HANG_SECONDS:.0f} s past the budget (a hang)")
    elapsed = time.monotonic() - started
    rss_after = rss(os.getpid())
    internal = service.stats.errors.get("internal", 0)
    longest_row = max(map(len, service.stats.rules.rows), default=0)
    if longest_key > MAX_INLINE_CHARS:
        tally.violation(f"a counter key holding {longest_key} characters of values")
    if longest_row > MAX_STAT_KEY_LENGTH:
        tally.violation(f"a metric row named by {longest_row} characters")
    ok = tally.violation_count == 0 and internal == 0
    notes = (
        f"{tally.cases:,} requests in {elapsed:.1f} s: {tally.summary()}; live counters at most "
        f"{peak_counters} (cap {cap}, {limiter.evictions:,} evicted), counter keys at most {longest_key} "
        f"characters of values, metric rows at most {longest_row}; RSS (this process) "
        f"{rss_before / MIB:.0f} -> {rss_after / MIB:.0f} MB"
    )
    if not ok:
        notes += f"; {tally.violation_count} violations: " + " | ".join(tally.violations)
    figures = {
        "cases": float(tally.cases),
        "answered": float(tally.outcomes["answered"]),
        "invalid_argument": float(tally.outcomes["INVALID_ARGUMENT"]),
        "internal": float(internal),
        "violations": float(tally.violation_count),
        "peak_live_counters": float(peak_counters),
        "max_counters": float(cap),
        "evictions": float(limiter.evictions),
        "longest_counter_key_chars": float(longest_key),
        "longest_metric_row_chars": float(longest_row),
        "rss_before_mb": round(rss_before / MIB, 1),
        "rss_after_mb": round(rss_after / MIB, 1),
        "seconds": round(elapsed, 2),
    }
    return Row(AREA, "request fuzz (in-process)", inputs=tally.cases, ok=ok, notes=notes, figures=figures)


# ---------------------------------------------------------------------------------
# Raw bytes to a real sidecar
# ---------------------------------------------------------------------------------


def send_all(address: str, payloads: Iterator[bytes], tally: Tally, in_flight: int = 32) -> None:
    """:func:`~loadtest.reliability_harness.hostile_requests.send_raw` on a channel of its own, counting the codes."""
    import grpc

    with grpc.insecure_channel(
        address, options=[*CHANNEL_OPTIONS, ("grpc.max_send_message_length", 4 * MAX_MESSAGE_BYTES)]
    ) as channel:
        method = channel.unary_unary(METHOD, request_serializer=None, response_deserializer=None)
        for payload, code in send_raw(method, payloads, in_flight):
            tally.cases += 1
            tally.outcomes[code.name] += 1
            if code not in expected_codes(payload):
                tally.violation(f"{len(payload)} bytes {payload[:24]!r}: {code.name}")


class Aftermath(NamedTuple):
    """How a sidecar came out of a flood of bad input."""

    alive: bool
    serving: bool
    rss_after: int
    hwm: int
    """Peak RSS (``VmHWM``)."""
    internal: int
    """``request_errors_total{kind="internal"}``: our own faults."""
    exceptions: int
    """Tracebacks in its log."""


def aftermath(sidecar: Any) -> Aftermath:
    """Read, after a flood, whether ``sidecar`` lives and serves, its memory, and its own faults."""
    from sidecar.client import health_status

    alive = sidecar.alive()
    rss_after = rss(sidecar.pid) if alive else 0
    hwm = (proc_status(sidecar.pid, "VmHWM") or 0) if alive else 0
    serving = alive and health_status(sidecar.address, timeout=5.0) == "SERVING"
    errors = scrape(sidecar.metrics_url) if alive else {}
    internal = int(errors.get('ratelimit_sidecar_request_errors_total{kind="internal"}', 0))
    return Aftermath(alive, serving, rss_after, hwm, internal, log_exceptions(sidecar))


class Flood(NamedTuple):
    """A flood of bad input and how the sidecar came out of it."""

    warm: Tally
    tally: Tally
    elapsed: float
    rss_before: int
    after: Aftermath


def warm_then_flood(
    sidecar: Any,
    send: Callable[[Iterator[bytes], Tally], None],
    inputs: Callable[[int, int], Iterator[bytes]],
    seed: int,
    count: int,
) -> Flood:
    """``WARM_UP`` inputs of another seed first (first-call costs stay out of the RSS baseline
    and the rate), then ``count`` inputs of ``seed`` timed, then the sidecar's aftermath."""
    warm = Tally()
    send(inputs(seed + 1, WARM_UP), warm)
    time.sleep(0.3)
    rss_before = rss(sidecar.pid)
    tally = Tally()
    started = time.monotonic()
    send(inputs(seed, count), tally)
    elapsed = time.monotonic() - started
    time.sleep(0.3)
    return Flood(warm, tally, elapsed, rss_before, aftermath(sidecar))


def flood_verdict(
    unit: str, flood: Flood, checks: Sequence[tuple[bool, str]] = ()
) -> tuple[bool, str, dict[str, float]]:
    """Whether a sidecar came out of a flood of ``unit`` (calls, bodies) well, a note
    saying how, and the figures every bad-input flood reports. ``checks``: more
    ``(held, what)`` for the note, each of which must hold too."""
    warm, tally, elapsed, rss_before, after = flood
    growth = after.rss_after - rss_before
    ok = (
        tally.violation_count == 0
        and warm.violation_count == 0
        and after.alive
        and after.serving
        and after.internal == 0
        and after.exceptions == 0
        and growth < RSS_GROWTH_LIMIT
        and all(held for held, _ in checks)
    )
    state = "alive and SERVING" if after.serving else "NOT SERVING" if after.alive else "DEAD"
    notes = (
        f"{tally.cases:,} {unit} in {elapsed:.1f} s: {tally.summary()}; process {state}, "
        + "".join(f"{what}, " for _, what in checks)
        + f"{after.internal} internal errors, {after.exceptions} exceptions logged; RSS "
        f"{rss_before / MIB:.1f} -> {after.rss_after / MIB:.1f} MB (growth {growth / MIB:+.1f} MB, limit "
        f"{RSS_GROWTH_LIMIT // MIB} MB; peak {after.hwm / MIB:.1f} MB)"
    )
    violations = tally.violation_count + warm.violation_count
    if violations:
        notes += f"; {violations} violations: " + " | ".join(warm.violations + tally.violations)
    figures = {
        "violations": float(violations),
        "internal": float(after.internal),
        "exceptions_logged": float(after.exceptions),
        "rss_before_mb": round(rss_before / MIB, 1),
        "rss_after_mb": round(after.rss_after / MIB, 1),
        "rss_growth_mb": round(growth / MIB, 1),
        "rss_peak_mb": round(after.hwm / MIB, 1),
        f"{unit}_per_second": round(tally.cases / elapsed, 1) if elapsed else 0.0,
    }
    return ok, notes, figures


def log_exceptions(child: Child) -> int:
    """Tracebacks and failed decisions in the sidecar's log."""
    text = child.log_text()
    return text.count("Traceback") + text.count("decision_failed")


def raw_bytes(context: Context) -> Row:
    """Random and mutated bytes to a real sidecar's ``ShouldRateLimit``."""

    count = 1_500 if context.quick else 12_000
    where = context.directory / "bad-input-raw"
    where.mkdir(parents=True, exist_ok=True)
    children: list[Child] = []
    with process_group() as group:
        try:
            args = ["--config", str(EXAMPLES), "--watch-config", "false", "--max-counters", "10000"]
            sidecar = start_sidecar(group, context, "sidecar", args, where)
            children.append(sidecar)
            flood = warm_then_flood(sidecar, partial(send_all, sidecar.address), raw_payloads, context.seed, count)
        except Exception as error:
            return failed_row(AREA, "raw bytes to gRPC", error, children)
    ok, notes, common = flood_verdict("calls", flood)
    tally = flood.tally
    figures = {
        "calls": float(tally.cases),
        "ok": float(tally.outcomes["OK"]),
        "invalid_argument": float(tally.outcomes["INVALID_ARGUMENT"]),
        "resource_exhausted": float(tally.outcomes["RESOURCE_EXHAUSTED"]),
        **common,
    }
    return Row(AREA, "raw bytes to gRPC", inputs=tally.cases, ok=ok, notes=notes, figures=figures)


# ---------------------------------------------------------------------------------
# Configs, loaded by a worker process
# ---------------------------------------------------------------------------------


def judge_config(directory: Path) -> dict[str, Any]:
    """Load ``directory/rules.yaml`` and check the outcome (runs in the worker)."""
    from sidecar.config.errors import ConfigError
    from sidecar.config.load import load_config

    path = directory / "rules.yaml"
    started = time.monotonic()
    try:
        config = load_config(directory)
    except ConfigError as error:
        seconds = time.monotonic() - started
        return {"outcome": "refused", "problems": refusal_problems(error, path, path.read_bytes()), "seconds": seconds}
    except Exception as error:
        return {"outcome": "crashed", "problems": [f"{type(error).__name__}: {error}"[:300]], "seconds": 0.0}
    seconds = time.monotonic() - started
    try:
        problems = exercise(config)
    except Exception as error:
        problems = [f"accepted, then failed at request time: {type(error).__name__}: {error}"[:300]]
    return {"outcome": "accepted", "problems": problems, "seconds": seconds}


def config_worker() -> None:
    """Read a directory per line on stdin, answer one JSON line each (``--config-worker``)."""
    with contextlib.suppress(ValueError, OSError):
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY, WORKER_MEMORY))
    for line in sys.stdin:
        try:
            answer = judge_config(Path(line.strip()))
        except BaseException as error:  # MemoryError included: report it, then go on
            answer = {"outcome": "crashed", "problems": [f"{type(error).__name__}: {error}"[:300]], "seconds": 0.0}
        answer["vm_rss"] = proc_status(os.getpid(), "VmRSS") or 0
        answer["vm_hwm"] = proc_status(os.getpid(), "VmHWM") or 0
        print(json.dumps(answer), flush=True)


class ConfigWorker:
    """A worker process judging configs; killed and started again when a load hangs or dies."""

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self.process: subprocess.Popen[str] | None = None
        self.restarts = 0

    def start(self) -> None:
        environment = dict(os.environ, PYTHONPATH=os.pathsep.join([str(LOADTEST), str(REPO)]))
        code = "from reliability_harness.bad_input import config_worker; config_worker()"
        with self.log_path.open("a") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-c", code],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                cwd=REPO,
                env=environment,
            )

    def judge(self, directory: Path, timeout: float) -> dict[str, Any]:
        if self.process is None or self.process.poll() is not None:
            self.start()
        process = self.process
        assert process is not None and process.stdin is not None and process.stdout is not None
        process.stdin.write(f"{directory}\n")
        process.stdin.flush()
        ready, _, _ = select.select([process.stdout], [], [], timeout)
        line = process.stdout.readline() if ready else ""
        if line:
            answer: dict[str, Any] = json.loads(line)
            return answer
        outcome = "hung" if process.poll() is None else f"worker died ({process.returncode})"
        self.stop()
        self.restarts += 1
        return {"outcome": outcome, "problems": [f"{outcome} loading {directory.name}"], "seconds": timeout}

    def stop(self) -> None:
        if self.process is not None:
            with contextlib.suppress(OSError):
                if self.process.stdin is not None:
                    self.process.stdin.close()
            if self.process.poll() is None:
                self.process.kill()
            self.process.wait(timeout=10)
            self.process = None


def config_fuzz(context: Context) -> Row:
    """Broken configs through ``load_config`` in a worker process, each with a time limit."""
    count = 150 if context.quick else 2_500
    cases = config_cases(context.seed, count, context.quick)
    where = context.directory / "bad-input-configs"
    where.mkdir(parents=True, exist_ok=True)
    worker = ConfigWorker(context.directory / "config-worker.log")
    tally = Tally()
    slowest = 0.0
    rss_first = rss_last = hwm = 0
    started = time.monotonic()
    try:
        for index, data in enumerate(cases):
            case = where / f"case-{index:05d}"
            case.mkdir()
            (case / "rules.yaml").write_bytes(data)
            answer = worker.judge(case, LOAD_TIMEOUT)
            shutil.rmtree(case, ignore_errors=True)
            tally.cases += 1
            tally.outcomes[answer["outcome"]] += 1
            slowest = max(slowest, float(answer.get("seconds", 0.0)))
            for problem in answer["problems"]:
                tally.violation(f"case {index} ({data[:40]!r}): {problem}")
            if answer.get("vm_rss"):
                rss_first = rss_first or int(answer["vm_rss"])
                rss_last = int(answer["vm_rss"])
                hwm = max(hwm, int(answer["vm_hwm"]))
    except Exception as error:
        return failed_row(AREA, "config fuzz", error)
    finally:
        worker.stop()
    elapsed = time.monotonic() - started
    ok = tally.violation_count == 0 and worker.restarts == 0
    notes = (
        f"{tally.cases:,} configs in {elapsed:.1f} s: {tally.summary()}; slowest load {slowest:.2f} s "
        f"(limit {LOAD_TIMEOUT:.0f} s); worker RSS {rss_first / MIB:.0f} -> {rss_last / MIB:.0f} MB, "
        f"peak {hwm / MIB:.0f} MB"
    )
    if not ok:
        notes += f"; {tally.violation_count} violations, {worker.restarts} restarts: " + " | ".join(tally.violations)
    figures = {
        "configs": float(tally.cases),
        "refused": float(tally.outcomes["refused"]),
        "accepted": float(tally.outcomes["accepted"]),
        "violations": float(tally.violation_count),
        "hangs_or_deaths": float(worker.restarts),
        "slowest_load_s": round(slowest, 3),
        "worker_rss_first_mb": round(rss_first / MIB, 1),
        "worker_rss_last_mb": round(rss_last / MIB, 1),
        "worker_rss_peak_mb": round(hwm / MIB, 1),
        "seconds": round(elapsed, 2),
    }
    return Row(AREA, "config fuzz", inputs=tally.cases, ok=ok, notes=notes, figures=figures)


# ---------------------------------------------------------------------------------


@contextlib.contextmanager
def quiet_sidecar_logs() -> Iterator[None]:
    """The in-process service logs evictions (the cap is tiny on purpose): keep the report clean."""
    import logging

    import structlog

    previous = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    try:
        yield
    finally:
        structlog.configure(**previous)


def run(context: Context) -> list[Row]:
    rows = []
    try:
        with quiet_sidecar_logs():
            rows.append(request_fuzz(context))
    except Exception as error:
        rows.append(failed_row(AREA, "request fuzz (in-process)", error))
    try:
        rows.append(raw_bytes(context))
    except Exception as error:
        rows.append(failed_row(AREA, "raw bytes to gRPC", error))
    try:
        rows.append(config_fuzz(context))
    except Exception as error:
        rows.append(failed_row(AREA, "config fuzz", error))
    return rows


if __name__ == "__main__":
    raise SystemExit(main(run))
