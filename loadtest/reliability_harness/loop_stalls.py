"""Loop stalls: what each hostile input costs the one event loop that answers every call (issue 25).

One event loop answers every ``ShouldRateLimit`` of the pod; past Envoy's 20-25 ms
timeout, Envoy fails open. Each row runs one input against a fresh sidecar process while
a probe calls ``ShouldRateLimit`` 200 times a second over gRPC on loopback
(:mod:`stall_measure`), and prints the probe's p50/p99/max and the loop-lag detector's
worst stall during the input next to a quiet run of the same probe right before, plus
RSS before, at peak and after. Rows:

1. **big report**: 100,000 bucket ids of 13 bytes on one ``StreamRateLimitQuotas``
   stream, back to back (1.3 MB: two messages under the 1 MiB cap);
2. **reconnect**: an Envoy-like stream reporting 20,000 valid buckets at once (the
   per-stream cap);
3. **outage**: ``--backend redis`` (quota shares on), 20,000 shared buckets live on a
   stream, then redis-server SIGSTOPped for 4 s, SIGCONTed, and 2 s of recovery;
4. **JSON body**: ``POST /json`` with 21,000 empty descriptors (63 KB), in a loop for 10 s;
5. **/config reader**: ``GET /config`` in a loop for 10 s with 20,000 quota buckets of
   ~1 KiB ids live;
6. **reload**: 20,000 live buckets, then one rule changed in the file and SIGHUP.

A row holds when every probe call was answered and the sidecar serves after the input.
The measured goals are printed beside it ("goal missed" with the figure), never asserted:
the probe's p99 within 2x of the quiet run, no stall over 20 ms, RSS back within 10 %.
``--quick`` uses smaller numbers, ``--smoke`` (the test) smaller still (:data:`SMOKE`).

    python -m loadtest.reliability --areas loop-stalls
    python -m loadtest.reliability_harness.loop_stalls [--full] [--floor]
"""

from __future__ import annotations

import contextlib
import http.client
import json
import signal
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from loadtest.reliability_harness.json_input import post
from loadtest.reliability_harness.quota_streams import QuotaStream, bucket_reports, tiny_ids_reports
from loadtest.reliability_harness.stall_measure import Figures, Hostile, Timing, measure, verdict
from loadtest.reliability_harness.support import (
    Context,
    ProcessGroup,
    RedisProcess,
    Row,
    SidecarProcess,
    encode_request,
    failed_row,
    free_port,
    main,
    process_group,
    redis_available,
    scrape,
    skipped_row,
    start_sidecar,
    wait_for,
)

AREA = "loop stalls"
DOMAIN = "q"
CONFIG = """\
domain: q
descriptors:
  - key: user
    rate_limit: {{unit: minute, requests_per_unit: {user_limit}}}
  - key: probe
    rate_limit: {{unit: second, requests_per_unit: 1000000}}
"""
PROBE_REQUEST = encode_request(DOMAIN, [[("probe", "steady")]])
QUOTA_TTL = 300
"""``--quota-ttl``: the assignments' refresh (every TTL/3) never falls inside a row."""
JSON_DESCRIPTORS = 21_000
ANSWER_LIMIT = 60.0
"""Seconds a one-shot input may take to be answered before the row gives up waiting."""
ANSWER_QUIET = 0.5
"""Seconds without a reply after which a stream's answer counts as complete."""
CONFIG_REPORT_BYTES = 256 * 1024
"""Reports of ~1 KiB ids for ``/config`` are cut this small: the sidecar's reply to one
report then fits one message whatever it does (up to 1,000 actions of 1 KiB ids per
reply message is over the 1 MiB cap)."""
LIVE_WAIT = 120.0
"""Seconds the setup may take to get its buckets live."""


@dataclass(frozen=True)
class Sizes:
    timing: Timing
    loop: float
    """Seconds a looping input (``POST /json``, ``GET /config``) runs."""
    tail: float
    """Seconds still measured after a one-shot input is answered."""
    tiny_ids: int
    buckets: int
    """Live buckets of the reconnect, outage and reload rows."""
    config_buckets: int
    """Live buckets of ~1 KiB ids behind ``/config``."""
    outage: float
    recovery: float
    process: str = "worker"
    """``--quota-process`` of the row's sidecar (:data:`PROCESSES`)."""


FULL = Sizes(Timing(quiet=5.0, settle=10.0), 10.0, 1.0, 100_000, 20_000, 20_000, 4.0, 2.0)
QUICK = Sizes(Timing(quiet=2.0, settle=3.0), 2.0, 0.5, 20_000, 2_000, 300, 1.5, 1.0)
SMOKE = Sizes(Timing(quiet=1.0, settle=1.5), 1.0, 0.3, 5_000, 1_000, 150, 1.0, 0.5)
"""The tests' size: every row and every figure, on half the quiet time and inputs of quick."""


def write_config(directory: Path, user_limit: int = 100) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "q.yaml").write_text(CONFIG.format(user_limit=user_limit))
    return directory


def sidecar_args(sizes: Sizes, config: Path, *extra: str) -> list[str]:
    return [
        "--config", str(config), "--quota-ttl", str(QUOTA_TTL), "--watch-config", "false",
        "--quota-process", sizes.process, *extra,
    ]  # fmt: skip


def live_buckets(sidecar: SidecarProcess) -> int:
    return int(scrape(sidecar.metrics_url, timeout=60).get("ratelimit_sidecar_quota_buckets", 0))


def make_live(
    sidecar: SidecarProcess, reports: list[bytes], count: int, streams: list[QuotaStream]
) -> tuple[QuotaStream, int]:
    """A stream holding ``count`` buckets (added to ``streams``, closed after the row): each report
    sent once the previous one is answered (so no reply has to carry more than one report's
    actions), then waited for until live."""
    stream = QuotaStream(sidecar.address)
    streams.append(stream)
    for report in reports:
        since = time.perf_counter()
        stream.send(report)
        stream.wait_quiet(since, ANSWER_QUIET / 2, LIVE_WAIT / len(reports))
    wait_for(lambda: live_buckets(sidecar) >= count or bool(stream.ended()), LIVE_WAIT, step=0.5)
    return stream, live_buckets(sidecar)


def connected(sidecar: SidecarProcess, streams: list[QuotaStream]) -> None:
    """One bucket reported and answered on a stream then closed: the quota worker runs before
    the quiet run, as it does once any Envoy is connected (its start is not the input's)."""
    stream, _ = make_live(sidecar, bucket_reports(DOMAIN, "user", 1), 1, streams)
    stream.close()
    wait_for(lambda: live_buckets(sidecar) == 0, LIVE_WAIT, step=0.1)


def answered(stream: QuotaStream, since: float, tail: float) -> Figures:
    """Wait (bounded) for the stream's answer to what was sent at ``since``, then ``tail`` more."""
    done = stream.wait_quiet(since, ANSWER_QUIET, ANSWER_LIMIT)
    time.sleep(tail)
    return {"answer_seconds": round(done - since, 2)}


# ---------------------------------------------------------------------------------
# Rows: each builds its input before the quiet run; the Hostile runs it
# ---------------------------------------------------------------------------------

Built = tuple[SidecarProcess, Hostile, Callable[[], str]]
"""A row's sidecar, its input, and what to say about the input afterwards."""
Setup = Callable[[ProcessGroup, Context, Sizes, list[QuotaStream]], Built]
"""Starts what a row needs."""


def on_a_new_stream(sidecar: SidecarProcess, reports: list[bytes], streams: list[QuotaStream], tail: float) -> Hostile:
    """The input of a stream's first reports: open a stream, send them all, wait for the answers."""

    def hostile() -> Figures:
        stream = QuotaStream(sidecar.address)
        streams.append(stream)
        since = time.perf_counter()
        for report in reports:
            stream.send(report)
        return answered(stream, since, tail)

    return hostile


def one_burst(
    setup: tuple[ProcessGroup, Context, Sizes, list[QuotaStream]],
    name: str,
    reports: list[bytes],
    what: Callable[[SidecarProcess], str],
) -> Built:
    """A row whose input is ``reports`` sent at once on a new stream; ``what`` says what they
    were, before what came back."""
    group, context, sizes, streams = setup
    sidecar = start_sidecar(group, context, name, sidecar_args(sizes, write_config(context.directory / name)))
    connected(sidecar, streams)

    def about() -> str:
        return f"{what(sidecar)}, stream {streams[-1].ended() or 'open'}"

    return sidecar, on_a_new_stream(sidecar, reports, streams, sizes.tail), about


def big_report(group: ProcessGroup, context: Context, sizes: Sizes, streams: list[QuotaStream]) -> Built:
    reports = tiny_ids_reports(DOMAIN, sizes.tiny_ids)

    def what(sidecar: SidecarProcess) -> str:
        sent = f"{sizes.tiny_ids:,} ids in {len(reports)} messages ({sum(map(len, reports)):,} bytes)"
        return f"{sent}; {streams[-1].actions():,} actions back"

    return one_burst((group, context, sizes, streams), "stalls-big", reports, what)


def reconnect(group: ProcessGroup, context: Context, sizes: Sizes, streams: list[QuotaStream]) -> Built:
    def what(sidecar: SidecarProcess) -> str:
        back = f"{streams[-1].actions():,} actions back, {live_buckets(sidecar):,} live"
        return f"{sizes.buckets:,} buckets reported at once; {back}"

    reports = bucket_reports(DOMAIN, "user", sizes.buckets)
    return one_burst((group, context, sizes, streams), "stalls-reconnect", reports, what)


def outage(group: ProcessGroup, context: Context, sizes: Sizes, streams: list[QuotaStream]) -> Built:
    config = write_config(context.directory / "stalls-outage")
    (context.directory / "stalls-redis").mkdir(parents=True, exist_ok=True)
    redis = group.start_ready(lambda: RedisProcess(context.directory / "stalls-redis"))
    args = sidecar_args(sizes, config, "--backend", "redis", "--redis-url", redis.url, "--redis-prefix", "stalls")
    sidecar = start_sidecar(group, context, "stalls-outage", args)
    stream, live = make_live(sidecar, bucket_reports(DOMAIN, "user", sizes.buckets), sizes.buckets, streams)
    before = stream.reply_count()

    def hostile() -> Figures:
        redis.signal(signal.SIGSTOP)
        try:
            time.sleep(sizes.outage)
        finally:
            redis.signal(signal.SIGCONT)
        time.sleep(sizes.recovery)
        return {"live_buckets": live}

    def about() -> str:
        return (
            f"{live:,} shared buckets live; redis-server stopped {sizes.outage:g} s, then {sizes.recovery:g} s "
            f"of recovery; {stream.reply_count() - before} replies meanwhile, stream {stream.ended() or 'open'}"
        )

    return sidecar, hostile, about


def json_body(group: ProcessGroup, context: Context, sizes: Sizes, streams: list[QuotaStream]) -> Built:
    config = write_config(context.directory / "stalls-json")
    port = free_port()
    args = sidecar_args(sizes, config, "--json-address", f"127.0.0.1:{port}")
    sidecar = start_sidecar(group, context, "stalls-json", args)
    body = json.dumps({"domain": DOMAIN, "descriptors": [{}] * JSON_DESCRIPTORS}, separators=(",", ":")).encode()
    statuses: Counter[str] = Counter()

    def hostile() -> Figures:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        deadline = time.monotonic() + sizes.loop
        try:
            while time.monotonic() < deadline:
                status, _ = post(connection, body)
                statuses[str(status)] += 1
        finally:
            connection.close()
        return {"posts": sum(statuses.values())}

    def about() -> str:
        answers = ", ".join(f"{count:,} x {status}" for status, count in statuses.most_common())
        return f"{len(body):,}-byte body of {JSON_DESCRIPTORS:,} empty descriptors, looped {sizes.loop:g} s: {answers}"

    return sidecar, hostile, about


def config_reader(group: ProcessGroup, context: Context, sizes: Sizes, streams: list[QuotaStream]) -> Built:
    config = write_config(context.directory / "stalls-config")
    sidecar = start_sidecar(group, context, "stalls-config", sidecar_args(sizes, config))
    reports = bucket_reports(DOMAIN, "user", sizes.config_buckets, value_bytes=1000, budget=CONFIG_REPORT_BYTES)
    _, live = make_live(sidecar, reports, sizes.config_buckets, streams)
    reads: list[tuple[float, int]] = []
    failures: Counter[str] = Counter()

    def hostile() -> Figures:
        deadline = time.monotonic() + sizes.loop
        while time.monotonic() < deadline:
            started = time.monotonic()
            try:
                with urllib.request.urlopen(sidecar.metrics_url + "/config", timeout=60) as reply:
                    reads.append((time.monotonic() - started, len(reply.read())))
            except OSError as error:
                failures[type(error).__name__] += 1
        return {"config_reads": len(reads), "live_buckets": live}

    def about() -> str:
        size = max((length for _, length in reads), default=0)
        mean = sum(seconds for seconds, _ in reads) / len(reads) if reads else 0.0
        failed = f", {sum(failures.values())} failed ({', '.join(failures)})" if failures else ""
        return (
            f"{live:,} buckets of ~1 KiB ids live; GET /config looped {sizes.loop:g} s: {len(reads)} reads of "
            f"{size / 1e6:.1f} MB, {mean * 1000:.0f} ms each{failed}"
        )

    return sidecar, hostile, about


def reload(group: ProcessGroup, context: Context, sizes: Sizes, streams: list[QuotaStream]) -> Built:
    config = write_config(context.directory / "stalls-reload")
    sidecar = start_sidecar(group, context, "stalls-reload", sidecar_args(sizes, config))
    stream, live = make_live(sidecar, bucket_reports(DOMAIN, "user", sizes.buckets), sizes.buckets, streams)
    seen: dict[str, float] = {}

    def reloads() -> int:
        return sidecar.log_text().count("config_reloaded")

    def hostile() -> Figures:
        before, replies = reloads(), stream.reply_count()
        write_config(config, user_limit=101)
        since = time.perf_counter()
        sidecar.signal(signal.SIGHUP)
        wait_for(lambda: reloads() > before, ANSWER_LIMIT, step=0.02)
        seen["reloaded_seconds"] = round(time.perf_counter() - since, 2)
        figures = answered(stream, since, sizes.tail)
        seen["pushed"] = stream.reply_count() - replies
        return {**figures, "reloaded_seconds": seen["reloaded_seconds"], "live_buckets": live}

    def about() -> str:
        return (
            f"{live:,} buckets live, one limit changed, SIGHUP: reloaded after {seen.get('reloaded_seconds', 0):g} s, "
            f"{seen.get('pushed', 0):.0f} reassignment messages pushed, stream {stream.ended() or 'open'}"
        )

    return sidecar, hostile, about


ROWS: dict[str, Setup] = {
    "big report: 100,000 tiny bucket ids on one RLQS stream": big_report,
    "reconnect: 20,000 buckets reported at once on a new stream": reconnect,
    "outage: redis-server stopped with 20,000 shared buckets live": outage,
    "JSON body: POST /json of 21,000 empty descriptors, looped": json_body,
    "/config reader: GET /config looped with 20,000 buckets of ~1 KiB ids": config_reader,
    "reload: one rule changed (SIGHUP) with 20,000 buckets live": reload,
}
"""Scenario name -> setup, in report order (the quick run uses smaller numbers than the names say)."""
NEEDS_REDIS = {outage}
NO_QUOTA = {json_body}
"""Rows whose input never reaches quota mode: run once, whatever ``--quota-process``."""
PROCESSES = ("worker", "inline")
"""Each quota row runs with the quota worker (the default) and inline, side by side."""
FLOOR = "floor"
"""``--floor``: each row once more with its input sent to a sidecar (quota worker on) while
the probe calls another, fresh one: what sharing the machine's cores alone costs the probe,
the best any split of the work into processes could do here."""


def run_row(context: Context, sizes: Sizes, scenario: str, setup: Setup, *, floor: bool = False) -> Row:
    """One row; with ``floor`` the probe calls a second sidecar, not the one given the input."""
    if setup in NEEDS_REDIS and not redis_available():
        return skipped_row(AREA, scenario, "redis-server is not installed")
    streams: list[QuotaStream] = []
    with process_group() as group:
        try:
            sidecar, hostile, about = setup(group, context, sizes, streams)
            if floor:  # the probe calls a sidecar the input never reaches
                probed = sidecar_args(sizes, write_config(context.directory / "stalls-probed"))
                sidecar = start_sidecar(group, context, "stalls-probed", probed)
            figures = measure(sidecar, PROBE_REQUEST, hostile, sizes.timing)
            return verdict(AREA, scenario, figures, about())
        except Exception as error:  # the report shows every row, even a broken one
            return failed_row(AREA, scenario, error, group.children)
        finally:
            for stream in streams:
                with contextlib.suppress(Exception):
                    stream.close()


def run(context: Context) -> list[Row]:
    """Every row, a quota row once per :data:`PROCESSES` (the tests' smoke size: the default
    only), and with the ``floor`` flag every row once more as :data:`FLOOR`."""
    floor = FLOOR in context.flags
    sizes = {"smoke": SMOKE, "quick": QUICK, "full": FULL}[context.size]
    processes = PROCESSES[:1] if context.smoke else PROCESSES
    rows = []
    for scenario, setup in ROWS.items():
        for process in processes[:1] if setup in NO_QUOTA else processes:
            named = scenario if setup in NO_QUOTA else f"{scenario} [{process}]"
            rows.append(run_row(context, replace(sizes, process=process), named, setup))
        if floor:  # the input's sidecar runs the default quota worker
            rows.append(run_row(context, sizes, f"{scenario} [{FLOOR}]", setup, floor=True))
    return rows


if __name__ == "__main__":
    raise SystemExit(main(run, flags={FLOOR: "each row once more with its input sent to another sidecar"}))
