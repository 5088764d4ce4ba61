"""Hostile input at the sidecar's edges (issue 21, defects 8 to 11), against real processes.

    python -m loadtest.reliability_harness.hardening_input [--full]
    python -m loadtest.reliability --areas hardening-input

Rows:

* a counter key overwritten in Redis (a hash; 2^63-1), in sync and strict mode: how many
  of 40 one-hit requests are admitted at a limit of 10 (the failure mode, ``local`` on one
  replica, must hold it to 10), whether Redis stayed up and the corrupt-key metric
  counted it (in-process limiters on a real redis-server, built as ``serve`` builds them);
* Redis URLs with a mistyped scheme, or an unencoded ``#``, ``/`` or ``?`` in the password:
  ``serve`` must exit 1 with one stderr line holding no piece of the password;
* a sparse 300 MB ``*.yaml`` in the config directory: ``check-config`` and a running
  sidecar's hot reload must refuse it without reading it (peak RSS added);
* ``nan``, ``inf`` and ``-inf`` for every float setting: ``serve`` must exit 1 with one line.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from loadtest.reliability_harness.support import (
    Context,
    RedisProcess,
    Row,
    failed_row,
    main,
    proc_status,
    process_group,
    start_sidecar,
    wait_for,
)
from stack.sidecar import clean_env, cli_argv, serve_argv

AREA = "bad input"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "config"
LIMIT = 10
REQUESTS = 40
HUGE = 300 * 1024 * 1024
SECRET_HALVES = ("Sup3r", "S3cret")
BAD_URLS = (
    "redis+sentinal://user:Sup3rS3cret@127.0.0.1:26379/mymaster",
    "REDIS://user:Sup3rS3cret@127.0.0.1:6379",
    "user:Sup3rS3cret@127.0.0.1:6379",
    "redis://user:Sup3r#S3cret@127.0.0.1:6379",
    "redis://user:Sup3r/S3cret@127.0.0.1:6379",
    "redis://user:Sup3r?S3cret@127.0.0.1:6379",
    "redis://Sup3r/S3cret@127.0.0.1:6379",
    "rediss://user:Sup3r#S3cret@127.0.0.1:6379",
    "redis+cluster://user:Sup3r?S3cret@127.0.0.1:7000",
    "redis+sentinel://user:Sup3r/S3cret@127.0.0.1:26379",
    "redis+sentinel://user:Sup3r?S3cret@127.0.0.1:26379/mymaster",
    "redis://user:Sup3rS3cret@127.0.0.1:99999",
    "redis://user:Sup3rS3cret@127.0.0.1:6379/zero",
    "redis://user:Sup3rS3cret@127.0.0.1:6379/0?socket_timeout=soon",
)
SERVE_TIMEOUT = 20.0
"""A value the sidecar wrongly accepts makes it serve: cut off after this, and counted as held wrong."""


def serve(env_extra: dict[str, str], *flags: str) -> subprocess.CompletedProcess[str]:
    """``python -m sidecar serve`` on the example config; killed if it starts serving."""
    command = serve_argv(["--config", str(EXAMPLES), *flags])
    env = clean_env() | {"RLS_GRPC_ADDRESS": "127.0.0.1:0", "RLS_METRICS_ADDRESS": ""} | env_extra
    try:
        return subprocess.run(command, capture_output=True, text=True, env=env, timeout=SERVE_TIMEOUT, check=False)
    except subprocess.TimeoutExpired as expired:
        stderr = expired.stderr.decode(errors="replace") if isinstance(expired.stderr, bytes) else expired.stderr or ""
        return subprocess.CompletedProcess(command, -1, "", stderr)


def one_line_refusal(done: subprocess.CompletedProcess[str]) -> bool:
    lines = done.stderr.strip().splitlines()
    return done.returncode == 1 and len(lines) == 1 and lines[0].startswith("ratelimit-sidecar: error: ")


# -- 8: a counter key that holds no counter ------------------------------------------------


def corrupt_run(url: str, mode: str, corruption: str) -> tuple[int, bool, int, int]:
    """Admitted of REQUESTS, whether Redis stayed up, the corrupt-key count and its log lines
    (the limiter's log is captured, not printed)."""
    from structlog.testing import capture_logs

    with capture_logs() as logs:
        admitted, up, counted = asyncio.run(corrupt_decisions(url, mode, corruption))
    return admitted, up, counted, sum(entry["event"] == "redis_corrupt_key" for entry in logs)


async def corrupt_decisions(url: str, mode: str, corruption: str) -> tuple[int, bool, int]:
    """Admitted of REQUESTS, whether Redis stayed up, and the corrupt-key count."""
    import redis

    from sidecar.limiter.protocol import Check
    from sidecar.limiter.redis.keys import counter_window
    from sidecar.limiter.sync import SyncLimiter
    from sidecar.server import build_redis_limiter
    from sidecar.settings import Settings

    settings = Settings(
        config="unused",
        backend="redis",
        mode=mode,  # type: ignore[arg-type]
        redis_url=url,
        redis_timeout=2.0,
        redis_prefix=f"h{uuid.uuid4().hex[:8]}",
        heartbeat_interval=0.5,
        sync_interval=60.0,
    )
    limiter: Any = build_redis_limiter(settings)
    await limiter.start()
    try:
        now = time.time()
        check = Check(("corrupt", mode, corruption), 3600, LIMIT, 1)
        key = counter_window(settings.redis_prefix, check.key, check.unit_seconds, now)[0]
        client = redis.Redis.from_url(url)
        if corruption == "hash":
            client.hset(key, "field", "1")
        else:
            client.set(key, str(2**63 - 1))
        client.close()
        admitted = 0
        for _ in range(REQUESTS):
            admitted += (await limiter.check([check], now)).admitted
            if isinstance(limiter, SyncLimiter):
                await limiter.sync_once()
        return admitted, limiter.store.available, limiter.store.corrupt.found_times
    finally:
        await limiter.close()


def corrupt_key_row(context: Context) -> Row:
    scenario = "a counter key overwritten in Redis (a hash; 2^63-1), sync and strict, limit 10"
    directory = context.directory / "corrupt-keys"
    directory.mkdir(parents=True, exist_ok=True)
    with process_group() as group:
        server = group.start_ready(lambda: RedisProcess(directory))
        figures: dict[str, float] = {}
        held = True
        parts = []
        for mode in ("sync", "strict"):
            for corruption in ("hash", "2^63-1"):
                admitted, up, counted, logged = corrupt_run(server.url, mode, corruption)
                figures[f"admitted_{mode}_{corruption}"] = admitted
                held = held and admitted <= LIMIT and up and counted > 0 and logged == 1
                parts.append(f"{mode} {corruption}: {admitted} ({logged} log line)")
    notes = (
        f"admitted of {REQUESTS}: {', '.join(parts)} (failure mode local, one replica); Redis stayed up, "
        "each key counted in ratelimit_sidecar_redis_corrupt_keys_total "
        "(before: sync 40 of 40 for both, strict 40 of 40 for 2^63-1)"
    )
    return Row(AREA, scenario, load=f"{4 * REQUESTS} requests", inputs=4, ok=held, notes=notes, figures=figures)


# -- 9: the Redis password in errors --------------------------------------------------------


SMOKE_URLS = (BAD_URLS[0], BAD_URLS[3])
"""The smoke size's URLs (a mistyped scheme, an unencoded ``#``): tests/sidecar/test_startup_errors.py
checks every one of ``BAD_URLS`` through ``serve``'s own path in-process, by flag and by environment,
with one real ``serve`` process per path."""


def redis_url_row(context: Context) -> Row:
    scenario = "Redis URLs: mistyped scheme, unencoded '#', '/', '?' in the password"
    urls = SMOKE_URLS if context.smoke else BAD_URLS
    refused = leaks = 0
    for url in urls:
        done = serve({"RLS_BACKEND": "redis", "RLS_REDIS_URL": url})
        refused += one_line_refusal(done)
        leaks += any(half in done.stderr + done.stdout for half in SECRET_HALVES)
    held = refused == len(urls) and leaks == 0
    notes = (
        f"{refused} of {len(urls)} refused with one stderr line and exit 1; {leaks} showed a piece of the password "
        "(before: the scheme typos repeated the URL, '#', '/', '?' ended in a traceback quoting it)"
    )
    figures = {"refused": float(refused), "leaks": float(leaks)}
    return Row(AREA, scenario, inputs=len(urls), ok=held, notes=notes, figures=figures)


# -- 10: a huge config file -----------------------------------------------------------------


def peak_rss_of(command: list[str]) -> tuple[subprocess.CompletedProcess[str], int]:
    """Run ``command`` in a child of a fresh interpreter; its peak RSS in bytes."""
    runner = (
        "import resource, subprocess, sys\n"
        "done = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
        "sys.stderr.write(done.stderr)\n"
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)\n"
        "sys.exit(done.returncode)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", runner, *command],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=120,
        check=False,
    )
    *lines, peak = done.stderr.strip().splitlines()
    return subprocess.CompletedProcess(done.args, done.returncode, done.stdout, "\n".join(lines)), int(peak) * 1024


def huge_config_row(context: Context) -> Row:
    scenario = "a sparse 300 MB *.yaml in the watched config directory"
    directory = context.directory / "huge-config"
    config = directory / "conf"
    config.mkdir(parents=True, exist_ok=True)
    for source in EXAMPLES.glob("*.yaml"):
        (config / source.name).write_bytes(source.read_bytes())
    check = cli_argv("check-config", str(config))
    _, normal = peak_rss_of(check)
    huge = config / "zz-huge.yaml"
    with huge.open("wb") as file:
        file.truncate(HUGE)
    started = time.monotonic()
    done, peak = peak_rss_of(check)
    check_seconds = time.monotonic() - started
    check_ok = done.returncode == 1 and f"{huge}: file is {HUGE:,} bytes" in done.stderr
    huge.unlink()
    with process_group() as group:
        sidecar = start_sidecar(group, context, "huge-config-sidecar", ["--config", str(config)], directory)
        before = proc_status(sidecar.pid, "VmHWM") or 0
        with huge.open("wb") as file:
            file.truncate(HUGE)
        refused = wait_for(lambda: "config_reload_refused" in sidecar.log_text(), timeout=20)
        after = proc_status(sidecar.pid, "VmHWM") or 0
        serving = sidecar.alive()
    huge.unlink()
    check_added, reload_added = (peak - normal) / 2**20, (after - before) / 2**20
    held = check_ok and refused and serving and check_added < 40 and reload_added < 40
    notes = (
        f"check-config refused it in {check_seconds:.2f} s, peak RSS {check_added:+.1f} MiB; a running sidecar's "
        f"reload refused it, peak RSS {reload_added:+.1f} MiB, still serving the old config "
        "(before, per issue 21: read whole, +1.2 GB RSS)"
    )
    figures = {"check_config_added_mib": check_added, "reload_added_mib": reload_added}
    return Row(AREA, scenario, inputs=2, ok=held, notes=notes, figures=figures)


# -- 11: non-finite numbers -----------------------------------------------------------------


def float_options() -> list[Any]:
    from sidecar.settings import SERVE_OPTIONS

    found = []
    for option in SERVE_OPTIONS:
        try:
            if isinstance(option.parse("0.5"), float):
                found.append(option)
        except ValueError:
            continue
    return found


def non_finite_row(context: Context) -> Row:
    """Smoke size: one setting (tests/sidecar/test_settings_finite.py checks ``nan``, ``inf`` and
    ``-inf`` in every float setting through ``serve``'s own path in-process, with one real process
    per path, and every spelling of non-finite through the parser)."""
    scenario = "nan, inf, -inf for every float setting"
    values = ("nan",) if context.quick else ("nan", "inf", "-inf")
    options = float_options()[:1] if context.smoke else float_options()
    refused = tried = 0
    for option in options:
        for value in values:
            tried += 1
            refused += one_line_refusal(serve({option.env: value}))
    notes = (
        f"{refused} of {tried} ({len(options)} settings x {', '.join(values)}) refused with one line and exit 1 "
        "(before: --clock-offset nan served and answered every call INTERNAL; --shutdown-grace nan skipped the drain)"
    )
    return Row(AREA, scenario, inputs=tried, ok=refused == tried, notes=notes, figures={"refused": float(refused)})


def run(context: Context) -> list[Row]:
    rows = []
    for build, name in (
        (corrupt_key_row, "corrupt counter keys"),
        (redis_url_row, "Redis URLs"),
        (huge_config_row, "huge config file"),
        (non_finite_row, "non-finite numbers"),
    ):
        try:
            rows.append(build(context))
        except Exception as error:  # a failed scenario is a row, never a missing area
            rows.append(failed_row(AREA, name, error))
    return rows


if __name__ == "__main__":
    sys.exit(main(run))
