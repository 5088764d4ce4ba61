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

``python -m reliability_harness.bad_input [--full]`` (from ``loadtest/``) runs it alone.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reliability_harness.support import (
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
UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
MAX_MESSAGE_BYTES = 1024 * 1024
"""The sidecar's gRPC receive cap: a bigger message is RESOURCE_EXHAUSTED before any parsing."""
RSS_GROWTH_LIMIT = 50 * MIB
"""What the sidecar may gain over a raw-bytes run (warm-up excluded): buffers and caches,
not a per-call leak (20,000 calls leaking 2.5 kB each would pass it)."""
LOAD_TIMEOUT = 20.0
"""Per config load in the worker: the slowest hostile file (8 MiB) takes a few seconds."""
WORKER_MEMORY = 4 * 1024 * MIB
"""Address-space cap of the config worker: a memory bomb fails there, not on the machine."""
EXAMPLES = REPO / "examples" / "config"
STRING_FIELDS = ("domain", "key", "value")
INVALID_UTF8 = (b"\xff", b"\x80", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe2\x82", b"\xfe\xfe\xff")
PLACEHOLDER = "Qz9Qz9Qz9"

FUZZ_RULES = """\
# Every feature of the descriptor config once, next to examples/config (domain demo).
domain: fuzz
descriptors:
  - key: k
    rate_limit: {unit: second, requests_per_unit: 3}
  - key: k
    value: "*a*a*a*b"
    rate_limit: {name: stars, unit: minute, requests_per_unit: 2}
  - key: zero
    rate_limit: {unit: hour, requests_per_unit: 0}
  - key: max
    rate_limit: {unit: year, requests_per_unit: 4294967295}
  - key: shared
    value: "p-*"
    share_threshold: true
    rate_limit: {unit: day, requests_per_unit: 5}
  - key: quota
    quota_mode: true
    rate_limit: {unit: week, requests_per_unit: 1}
  - key: shadow
    shadow_mode: true
    rate_limit: {unit: month, requests_per_unit: 1}
  - key: detailed
    detailed_metric: true
    rate_limit: {unit: second, requests_per_unit: 10}
    descriptors:
      - key: inner
        rate_limit: {name: inner, unit: minute, requests_per_unit: 1, replaces: [{name: stars}]}
  - key: free
    rate_limit: {unlimited: true}
"""
CONFIG_KEYS = (
    *("remote_address", "generic_key", "api_key", "header_match", "k", "zero", "max", "shared"),
    *("quota", "shadow", "detailed", "inner", "free"),
)
CONFIG_VALUES = (
    *("", "api", "login", "write", "premium-1", "internal-monitoring", "p-1", "aaab"),
    *("a" * 4095 + "b", "a" * 4096, "\x00", "{}\n:_"),
)
ALPHABETS = (
    "abcxyz019",
    "_:{}\n\t\\\"' ",
    "".join(map(chr, range(0x20, 0x7F))),
    "äöüßжя中文ü\u200b\ufeff\U0001f600\U0010fffd",
)


# ---------------------------------------------------------------------------------
# Requests, random and mutated
# ---------------------------------------------------------------------------------


def random_text(rng: random.Random, longest: int = 12) -> str:
    """Unicode without lone surrogates (protobuf strings are UTF-8), often with separators."""
    alphabet = rng.choice(ALPHABETS)
    if rng.random() < 0.1:
        return "".join(
            chr(rng.choice([rng.randrange(0x20, 0xD800), rng.randrange(0xE000, 0x110000)])) for _ in range(4)
        )
    return "".join(rng.choice(alphabet) for _ in range(rng.randrange(longest + 1)))


def giant_text(rng: random.Random) -> str:
    return rng.choice("xж\U0001f600") * rng.choice([257, 4096, 4097, 70_000])


def pick(rng: random.Random, *choices: Callable[[], Any]) -> Any:
    return rng.choice(choices)()


def random_request(rng: random.Random, wild: bool | None = None) -> Any:
    """Half wild (any domain, 0 to 1000 descriptors of anything), half plausible
    (the config's domains and keys, numbers in range), so answers and refusals are many."""
    from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
    from envoy.service.ratelimit.v3 import rls_pb2

    descriptor_type = ratelimit_pb2.RateLimitDescriptor
    entry_type = descriptor_type.Entry
    if wild is None:
        wild = rng.random() < 0.5

    def entry(small: bool) -> Any:
        if not wild:
            key = rng.choice(CONFIG_KEYS)
            value = rng.choice(CONFIG_VALUES) if rng.random() < 0.6 else random_text(rng)
        elif small:
            key = pick(rng, lambda: rng.choice(CONFIG_KEYS), lambda: random_text(rng))
            value = pick(rng, lambda: rng.choice(CONFIG_VALUES), lambda: random_text(rng))
        else:
            key = pick(rng, lambda: rng.choice(CONFIG_KEYS), lambda: random_text(rng), lambda: giant_text(rng))
            value = pick(rng, lambda: rng.choice(CONFIG_VALUES), lambda: random_text(rng), lambda: giant_text(rng))
        return entry_type(key=key, value=value)

    def descriptor(small: bool) -> Any:
        if not wild:
            entries = [entry(True)] * 32 if rng.random() < 0.05 else [entry(True) for _ in range(rng.randint(1, 3))]
        elif small or rng.random() < 0.7:
            entries = [entry(small) for _ in range(rng.randint(0, 4))]
        else:
            entries = [entry(True)] * rng.choice([0, 32, 33, 500])
        built = descriptor_type(entries=entries)
        if rng.random() < 0.25:
            unit = rng.choice([0, 8, 99, -1, 2**31 - 1, -(2**31), *range(1, 8)]) if wild else rng.randint(1, 7)
            requests = rng.choice([0, 1, UINT32_MAX, rng.randrange(UINT32_MAX + 1)])
            built.limit.CopyFrom(descriptor_type.RateLimitOverride(requests_per_unit=requests, unit=unit))
        if rng.random() < 0.3:
            top = UINT64_MAX if wild else UINT32_MAX
            built.hits_addend.SetInParent()
            built.hits_addend.value = rng.choice(
                [0, 1, UINT32_MAX, min(top, UINT32_MAX + 1), top, rng.randrange(top + 1)]
            )
        return built

    if wild:
        domain = pick(
            rng, lambda: rng.choice(["demo", "fuzz", "unknown", ""]), lambda: random_text(rng), lambda: giant_text(rng)
        )
        if rng.random() < 0.8:
            descriptors = [descriptor(False) for _ in range(rng.randint(1, 5))]
        else:
            descriptors = [descriptor(True)] * rng.choice([0, 64, 65, 1000])
    else:
        domain = rng.choice(["demo", "fuzz"])
        if rng.random() < 0.1:
            descriptors = [descriptor(False)] * 64
        else:
            descriptors = [descriptor(False) for _ in range(rng.randint(1, 5))]
    hits = rng.choice([0, 0, 1, UINT32_MAX, rng.randrange(UINT32_MAX + 1)])
    return rls_pb2.RateLimitRequest(domain=domain, descriptors=descriptors, hits_addend=hits)


def mutate(rng: random.Random, data: bytes) -> bytes:
    """A few flips, inserts, deletes, truncations or duplicated runs, anywhere."""
    buffer = bytearray(data)
    for _ in range(rng.randint(1, 6)):
        at = rng.randrange(len(buffer) + 1)
        kind = rng.randrange(5)
        if kind == 0 and at < len(buffer):
            buffer[at] ^= rng.randrange(1, 256)
        elif kind == 1:
            buffer[at:at] = bytes([rng.randrange(256)])
        elif kind == 2:
            del buffer[at : at + rng.randint(1, 8)]
        elif kind == 3:
            del buffer[at:]
        else:
            buffer[at:at] = buffer[at : at + rng.randint(1, 64)]
    return bytes(buffer)


def with_invalid_utf8(rng: random.Random, request: Any) -> bytes | None:
    """``request`` serialized with invalid UTF-8 in one string field (same length: the
    placeholder's bytes are swapped on the wire; Python cannot build such a message)."""
    field_name = rng.choice(STRING_FIELDS)
    if field_name == "domain":
        request.domain = PLACEHOLDER
    else:
        entries = [entry for descriptor in request.descriptors for entry in descriptor.entries]
        if not entries:
            return None
        setattr(rng.choice(entries), field_name, PLACEHOLDER)
    data: bytes = request.SerializeToString()
    if data.count(PLACEHOLDER.encode()) != 1:
        return None
    bad = (rng.choice(INVALID_UTF8) + b"a" * len(PLACEHOLDER))[: len(PLACEHOLDER)]
    return data.replace(PLACEHOLDER.encode(), bad)


def special_payloads() -> list[bytes]:
    """Hand-made wire formats: truncated lengths, huge varints, deep groups, the size cap."""
    return [
        b"",
        b"\x00",
        b"\x0a\xff\xff\xff\xff\x0f",  # domain claiming a 4 GiB length
        b"\x0a" + b"\xff" * 20,  # an endless varint
        b"\x18" + b"\xff" * 9 + b"\x01",  # hits_addend overflowing uint64
        b"\x18\xff\xff\xff\xff\x1f",  # hits_addend past uint32
        b"\x7b" * 100_000,  # 100,000 nested unknown groups
        b"\x12\x04\x0a\x02\x0a\x00" * 20_000,  # 20,000 descriptors with an empty key
        b"\x0a\x04demo" + b"\x12\x08\x0a\x06\x0a\x01k\x12\x01v" * 60_000,  # 60,000 descriptors
        b"\x0a\x04demo" + b"\x12\x00" * 400_000,  # 400,000 empty descriptors
        b"\x0a\x04demo\x12" + b"\xa0\x9c\x01" + b"\x0a\x9c\x9c\x01" + b"x" * 20_000,  # truncated nesting
        b"\x0a\x04demo" + b"\x92\x01\x00" * 1000,  # unknown length-delimited fields
        b"\x0a" + bytes([len(PLACEHOLDER)]) + b"\xed\xa0\x80" * 3,  # a UTF-16 surrogate as domain
        b"x" * (MAX_MESSAGE_BYTES + 1),  # over the gRPC cap
    ]


def raw_payloads(seed: int, count: int) -> Iterator[bytes]:
    """``count`` payloads: the specials, then random bytes, mutated requests, invalid UTF-8
    and valid requests in turn (valid ones keep the handler's real path busy too)."""
    rng = random.Random(seed)
    specials = special_payloads()
    yield from specials[:count]
    for index in range(max(0, count - len(specials))):
        kind = index % 4
        if kind == 0:
            yield rng.randbytes(rng.choice([rng.randrange(40), rng.randrange(2000)]))
        elif kind == 1:
            yield mutate(rng, random_request(rng, wild=False).SerializeToString())
        elif kind == 2:
            yield with_invalid_utf8(rng, random_request(rng)) or b"\x0a\x01\xff"
        else:
            yield random_request(rng).SerializeToString()


def bound_broken(request: Any) -> bool:
    """README "Request bounds", written independently of ``sidecar.validate``."""
    if not 1 <= len(request.domain) <= 256 or not 1 <= len(request.descriptors) <= 64:
        return True
    for descriptor in request.descriptors:
        if not 1 <= len(descriptor.entries) <= 32:
            return True
        if any(not 1 <= len(entry.key) <= 256 or len(entry.value) > 4096 for entry in descriptor.entries):
            return True
        if descriptor.HasField("limit") and not 1 <= descriptor.limit.unit <= 7:
            return True
        if descriptor.HasField("hits_addend") and descriptor.hits_addend.value > UINT32_MAX:
            return True
    return False


def response_problem(request: Any, response: Any) -> str | None:
    """What is wrong with an answer, or None."""
    from envoy.service.ratelimit.v3 import rls_pb2

    ok, over = rls_pb2.RateLimitResponse.OK, rls_pb2.RateLimitResponse.OVER_LIMIT
    parsed = rls_pb2.RateLimitResponse.FromString(response.SerializeToString())
    if parsed.overall_code not in (ok, over):
        return f"overall_code {parsed.overall_code}"
    if len(parsed.statuses) != len(request.descriptors):
        return f"{len(parsed.statuses)} statuses for {len(request.descriptors)} descriptors"
    for index, status in enumerate(parsed.statuses):
        if status.code not in (ok, over):
            return f"statuses[{index}].code {status.code}"
        if status.HasField("current_limit") and (
            status.current_limit.unit not in range(1, 8)
            or status.limit_remaining > status.current_limit.requests_per_unit
        ):
            return f"statuses[{index}]: remaining {status.limit_remaining} of {status.current_limit}"
    if parsed.overall_code == over and all(status.code == ok for status in parsed.statuses):
        return "OVER_LIMIT overall with every descriptor OK"
    return None


# ---------------------------------------------------------------------------------
# In-process service
# ---------------------------------------------------------------------------------


class AbortedError(Exception):
    def __init__(self, code: Any, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details


class AbortingContext:
    """Enough of a ``ServicerContext`` for the handler."""

    async def abort(self, code: Any, details: str) -> None:
        raise AbortedError(code, details)


def drive(coroutine: Coroutine[Any, Any, Any]) -> Any:
    """Run the handler to its end: on the memory backend nothing it awaits suspends."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise RuntimeError("the handler suspended on the memory backend")


def fuzz_config(extra_rules: str | None = FUZZ_RULES) -> Any:
    from sidecar.config.load import load_config, parse_text
    from sidecar.config.model import RateLimitConfig

    example = load_config(EXAMPLES)
    if extra_rules is None:
        return example
    domain, issues = parse_text(extra_rules, "fuzz.yaml")
    if domain is None:
        raise RuntimeError(f"the fuzz rules do not load: {issues}")
    return RateLimitConfig({**example.domains, domain.name: domain}, (*example.files, "fuzz.yaml"), "fuzz")


class SteppingClock:
    def __init__(self, now: float = 1_700_000_000.25) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


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
    import grpc

    try:
        response = drive(service.ShouldRateLimit(request, AbortingContext()))
    except AbortedError as abort:
        if abort.code != grpc.StatusCode.INVALID_ARGUMENT:
            tally.outcomes[abort.code.name] += 1
            tally.violation(f"{what}: {abort}")
            return
        tally.outcomes["INVALID_ARGUMENT"] += 1
        if request is not None and not bound_broken(request):
            tally.violation(f"{what}: a valid request refused: {abort.details}")
        return
    except Exception as error:
        tally.outcomes["exception"] += 1
        tally.violation(f"{what}: {type(error).__name__}: {error}")
        return
    tally.outcomes["answered"] += 1
    if request is None or bound_broken(request):
        tally.violation(f"{what}: a request breaking a bound was answered")
        return
    problem = response_problem(request, response)
    if problem is not None:
        tally.violation(f"{what}: {problem}")


HANG_SECONDS = 20.0
"""A call still running this long after the in-process budget ended is a hang."""


class OverranError(BaseException):
    """Raised by :func:`alarm_after`; a BaseException so the code under test cannot swallow it."""


@contextlib.contextmanager
def alarm_after(seconds: float) -> Iterator[None]:
    """Interrupt the block after ``seconds`` with :class:`OverranError` (main thread only:
    elsewhere signals cannot be used and the block runs unbounded)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expired(signum: int, frame: Any) -> None:
        raise OverranError

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def fuzz_case(rng: random.Random, tally: Tally) -> Any:
    """The next request: random messages half the time, else parsed from mutated bytes or
    from bytes with invalid UTF-8 in a string field (None: not a message)."""
    from sidecar.service import parse_request

    kind = tally.cases % 4
    if kind in (0, 1):
        return random_request(rng)
    if kind == 2:
        return parse_request(mutate(rng, random_request(rng, wild=False).SerializeToString()))
    request = parse_request(with_invalid_utf8(rng, random_request(rng)) or b"\x0a\x01\xff")
    if request is not None:
        tally.violation("invalid UTF-8 in a string field was parsed")
    return request


def request_fuzz(context: Context) -> Row:
    """Random and mutated requests through the handler, in this process."""
    from sidecar.limiter.keys import MAX_INLINE_CHARS
    from sidecar.limiter.memory import MemoryLimiter
    from sidecar.metrics import MAX_STAT_KEY_LENGTH
    from sidecar.service import RateLimitService

    count, budget = (3_000, 10.0) if context.quick else (60_000, 30.0)
    cap = 16
    rng = random.Random(context.seed)
    clock = SteppingClock()
    limiter = MemoryLimiter(max_counters=cap)
    service = RateLimitService(fuzz_config(), limiter, clock=clock)
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
        with alarm_after(budget + HANG_SECONDS):
            while tally.cases < count and time.monotonic() - started < budget:
                tally.cases += 1
                clock.now += rng.choice([0.0, 0.0, 0.0, 0.001, 0.5, 1.0, 61.0, 3601.0, 90_000.0])
                check_call(service, fuzz_case(rng, tally), tally, f"case {tally.cases}")
                peak_counters = max(peak_counters, limiter.live_counters)
                if limiter.live_counters > cap:
                    tally.violation(f"case {tally.cases}: {limiter.live_counters} live counters, cap {cap}")
    except OverranError:
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


def send_raw(address: str, payloads: Iterator[bytes], tally: Tally, in_flight: int = 32) -> None:
    """Unary calls with identity serializers (the bytes go out as they are), ``in_flight`` at once."""
    import grpc

    with grpc.insecure_channel(
        address, options=[*CHANNEL_OPTIONS, ("grpc.max_send_message_length", 4 * MAX_MESSAGE_BYTES)]
    ) as channel:
        method = channel.unary_unary(METHOD, request_serializer=None, response_deserializer=None)
        pending: list[tuple[bytes, Any]] = []

        def settle(payload: bytes, future: Any) -> None:
            tally.cases += 1
            try:
                future.result()
                code = grpc.StatusCode.OK
            except grpc.RpcError as error:
                code = error.code()
            tally.outcomes[code.name] += 1
            allowed = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}
            if len(payload) > MAX_MESSAGE_BYTES:
                allowed = {grpc.StatusCode.RESOURCE_EXHAUSTED}
            if code not in allowed:
                tally.violation(f"{len(payload)} bytes {payload[:24]!r}: {code.name}")

        for payload in payloads:
            pending.append((payload, method.future(payload, timeout=10.0)))
            if len(pending) >= in_flight:
                settle(*pending.pop(0))
        for payload, future in pending:
            settle(payload, future)


def log_exceptions(child: Child) -> int:
    """Tracebacks and failed decisions in the sidecar's log."""
    text = child.log_text()
    return text.count("Traceback") + text.count("decision_failed")


def raw_bytes(context: Context) -> Row:
    """Random and mutated bytes to a real sidecar's ``ShouldRateLimit``."""
    from sidecar.client import health_status

    count = 1_500 if context.quick else 12_000
    warm_up = 300
    where = context.directory / "bad-input-raw"
    where.mkdir(parents=True, exist_ok=True)
    children: list[Child] = []
    with process_group() as group:
        try:
            args = ["--config", str(EXAMPLES), "--watch-config", "false", "--max-counters", "10000"]
            sidecar = start_sidecar(group, context, "sidecar", args, where)
            children.append(sidecar)
            warm = Tally()
            send_raw(sidecar.address, raw_payloads(context.seed + 1, warm_up), warm)
            time.sleep(0.3)
            rss_before = rss(sidecar.pid)
            tally = Tally()
            started = time.monotonic()
            send_raw(sidecar.address, raw_payloads(context.seed, count), tally)
            elapsed = time.monotonic() - started
            time.sleep(0.3)
            alive = sidecar.alive()
            rss_after = rss(sidecar.pid) if alive else 0
            hwm = (proc_status(sidecar.pid, "VmHWM") or 0) if alive else 0
            serving = alive and health_status(sidecar.address, timeout=5.0) == "SERVING"
            errors = scrape(sidecar.metrics_url) if alive else {}
            internal = int(errors.get('ratelimit_sidecar_request_errors_total{kind="internal"}', 0))
            exceptions = log_exceptions(sidecar)
        except Exception as error:
            return failed_row(AREA, "raw bytes to gRPC", error, children)
    growth = rss_after - rss_before
    ok = (
        tally.violation_count == 0
        and warm.violation_count == 0
        and alive
        and serving
        and internal == 0
        and exceptions == 0
        and growth < RSS_GROWTH_LIMIT
    )
    notes = (
        f"{tally.cases:,} calls in {elapsed:.1f} s: {tally.summary()}; process "
        f"{'alive and SERVING' if serving else 'NOT SERVING' if alive else 'DEAD'}, {internal} internal errors, "
        f"{exceptions} exceptions logged; RSS {rss_before / MIB:.1f} -> {rss_after / MIB:.1f} MB "
        f"(growth {growth / MIB:+.1f} MB, limit {RSS_GROWTH_LIMIT // MIB} MB; peak {hwm / MIB:.1f} MB)"
    )
    if tally.violation_count or warm.violation_count:
        notes += f"; {tally.violation_count + warm.violation_count} violations: " + " | ".join(
            warm.violations + tally.violations
        )
    figures = {
        "calls": float(tally.cases),
        "ok": float(tally.outcomes["OK"]),
        "invalid_argument": float(tally.outcomes["INVALID_ARGUMENT"]),
        "resource_exhausted": float(tally.outcomes["RESOURCE_EXHAUSTED"]),
        "violations": float(tally.violation_count + warm.violation_count),
        "internal": float(internal),
        "rss_before_mb": round(rss_before / MIB, 1),
        "rss_after_mb": round(rss_after / MIB, 1),
        "rss_growth_mb": round(growth / MIB, 1),
        "rss_peak_mb": round(hwm / MIB, 1),
        "calls_per_second": round(tally.cases / elapsed, 1) if elapsed else 0.0,
    }
    return Row(AREA, "raw bytes to gRPC", inputs=tally.cases, ok=ok, notes=notes, figures=figures)


# ---------------------------------------------------------------------------------
# Configs, loaded by a worker process
# ---------------------------------------------------------------------------------

RICH = """\
domain: rich
metadata: {owner: team-a, tags: [x, y]}
descriptors:
  - key: remote_address
    rate_limit: {name: per_ip, unit: second, requests_per_unit: 20}
  - key: route
    value: api
    metadata: {note: route}
    rate_limit: {name: api, unit: Minute, requests_per_unit: 50}
    descriptors:
      - key: user
        value: "premium-*"
        share_threshold: true
        detailed_metric: true
        rate_limit: {name: premium, unit: hour, requests_per_unit: 100, replaces: [{name: api}]}
      - key: user
        quota_mode: true
        rate_limit: {unit: day, requests_per_unit: 0}
      - key: user
        value: monitor
        rate_limit: {unlimited: true}
  - key: shadow
    value: 010
    shadow_mode: true
    rate_limit: {unit: week, requests_per_unit: 4294967295}
"""
REPLACEMENTS: tuple[Any, ...] = (
    *(None, True, 0, -1, 1.5, 2**32, 2**70, "", "*", "second", "ü{}\n:_", "x" * 300),
    *([], [1, "a"], {}, {"key": "k"}, {"x": {"y": [None]}}),
)
YAML_BITS = (
    *("&a ", "*a", "<<: *a", "- ", ": ", "{", "}", "[", "]", "!!binary ", "!!python/object ", "? ", "|", "'", '"'),
    *("\t", "#", "---", "...", "%YAML 1.1", "~", "0x1F", "1e3", ".nan", "2024-01-01", "*", "key: k", "\\", "\x00"),
)
FIELD_NAMES = (
    *("domain", "descriptors", "key", "value", "rate_limit", "unit", "requests_per_unit", "unlimited", "name"),
    *("replaces", "shadow_mode", "quota_mode", "detailed_metric", "share_threshold", "metadata"),
)
VALID = "domain: huge\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n"


def locations(node: Any, at: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield at
    if isinstance(node, dict):
        for key, value in node.items():
            yield from locations(value, (*at, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from locations(value, (*at, index))


def replaced(document: Any, at: tuple[Any, ...], value: Any) -> Any:
    if not at:
        return value
    changed = copy.deepcopy(document)
    parent = changed
    for step in at[:-1]:
        parent = parent[step]
    if value is REMOVE:
        del parent[at[-1]]
    else:
        parent[at[-1]] = value
    return changed


REMOVE = object()


def dump(document: Any) -> bytes:
    import yaml

    return yaml.safe_dump(document, sort_keys=False, allow_unicode=True).encode()


def field_swaps() -> list[bytes]:
    """Every node of two valid configs replaced by every other type, or removed."""
    import yaml

    cases = []
    for text in ((EXAMPLES / "demo.yaml").read_text(), RICH):
        document = yaml.safe_load(text)
        for at in locations(document):
            cases += [dump(replaced(document, at, value)) for value in REPLACEMENTS]
            if at:
                cases.append(dump(replaced(document, at, REMOVE)))
    return cases


def line_mutation(rng: random.Random, text: str) -> bytes:
    """Duplicated lines (duplicate keys), deleted, swapped, re-indented lines, YAML syntax inserted."""
    lines = text.splitlines()
    for _ in range(rng.randint(1, 5)):
        if not lines:
            break
        at = rng.randrange(len(lines))
        kind = rng.randrange(5)
        if kind == 0:
            lines.insert(at, lines[at])
        elif kind == 1:
            del lines[at]
        elif kind == 2:
            other = rng.randrange(len(lines))
            lines[at], lines[other] = lines[other], lines[at]
        elif kind == 3:
            lines[at] = " " * rng.randrange(7) + lines[at].lstrip()
        else:
            column = rng.randrange(len(lines[at]) + 1)
            lines[at] = lines[at][:column] + rng.choice(YAML_BITS) + lines[at][column:]
    return ("\n".join(lines) + "\n").encode()


def random_document(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.random()
    if depth >= 3 or roll < 0.5:
        return rng.choice(
            [None, True, False, 0, -7, 2**40, 1.5, float("nan"), "", "second", "*", "a*b", random_text(rng, 6)]
        )
    if roll < 0.7:
        return [random_document(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {
        rng.choice([*FIELD_NAMES, random_text(rng, 4)]): random_document(rng, depth + 1)
        for _ in range(rng.randrange(5))
    }


def laughs(levels: int, width: int) -> str:
    lines = ["domain: d", "metadata:", "  l0: &l0 [lol]"]
    lines += [f"  l{n}: &l{n} [{', '.join([f'*l{n - 1}'] * width)}]" for n in range(1, levels)]
    return "\n".join(lines) + "\n"


def descriptor_laughs(levels: int, width: int) -> str:
    lines = ["domain: d", "metadata:", "  l0: &l0 {key: k, rate_limit: {unit: second, requests_per_unit: 1}}"]
    lines += [f"  l{n}: &l{n} {{key: k, descriptors: [{', '.join([f'*l{n - 1}'] * width)}]}}" for n in range(1, levels)]
    lines.append(f"descriptors: [{', '.join([f'*l{levels - 1}'] * width)}]")
    return "\n".join(lines) + "\n"


def merge_bomb(levels: int) -> str:
    node = "&a0 {x: 1, y: 2}"
    for level in range(1, levels):
        node = f"&a{level} {{<<: [{node}, *a{level - 1}]}}"
    return f"domain: d\nmetadata: {node}\n"


def hostile_files(quick: bool) -> list[bytes]:
    """Empty, binary, bombs, deep nesting, huge; the slow ones (a second or more) only in full runs."""
    cases = [
        b"",
        b"  \n\n\t\n",
        b"---\n",
        (VALID + "---\n" + VALID).encode(),
        VALID.encode().replace(b"huge", b"hu\x00ge"),
        VALID.encode().replace(b"huge", b"hu\xffge"),
        VALID.encode("utf-16"),
        b"\xef\xbb\xbf" + VALID.encode(),
        (VALID + "domain: again\n").encode(),
        b"domain: !!python/object/apply:os.system ['true']\n",
        b"? [a, b]\n: 1\ndomain: d\n",
        b"domain: d\nmetadata: &a [*a]\n",
        b"domain: d\ndescriptors: &d [{key: k, descriptors: *d}]\n",
        b"{a: " * 5_000 + b"1" + b"}" * 5_000,
        "".join(" " * depth + "a:\n" for depth in range(3000)).encode(),
        laughs(10, 10).encode(),
        descriptor_laughs(8, 16).encode(),
        merge_bomb(40).encode(),
        (VALID + "# " + "x" * (9 * MIB) + "\n").encode(),
    ]
    if not quick:
        cases += [
            b"[" * 100_000 + b"]" * 100_000,
            (VALID + "metadata: " + "x" * (3 * MIB) + "\n").encode(),
            VALID.replace("key: k", "key: k\n    value: " + "v" * 1_000_000).encode(),
            (VALID + "".join(f"x{n}: {n}\n" for n in range(20_000))).encode(),
            ("domain: d\nmetadata: [" + "1, " * (8 * MIB // 3 - 20) + "]\n").encode(),
        ]
    return cases


def config_cases(seed: int, count: int, quick: bool) -> list[bytes]:
    """``count`` configs (at least the hostile files): a third field swaps (sampled), the rest
    line and byte mutations, random documents and binary junk."""
    rng = random.Random(seed)
    hostile = hostile_files(quick)
    swaps = field_swaps()
    rest = max(0, count - len(hostile))
    chosen = rng.sample(swaps, min(len(swaps), rest // 3))
    bases = [(EXAMPLES / "demo.yaml").read_text(), RICH]
    while len(chosen) < rest:
        kind = len(chosen) % 4
        if kind == 0:
            chosen.append(line_mutation(rng, rng.choice(bases)))
        elif kind == 1:
            chosen.append(mutate(rng, rng.choice(bases).encode()))
        elif kind == 2:
            chosen.append(dump({"domain": random_document(rng), "descriptors": random_document(rng)}))
        else:
            chosen.append(rng.randbytes(rng.randrange(2000)))
    return hostile + chosen


def config_requests(config: Any, limit: int = 40) -> Iterator[Any]:
    """Requests from the config's own descriptors: one per node (its path from the root,
    wildcards filled in), then all of them at once."""
    from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
    from envoy.service.ratelimit.v3 import rls_pb2

    descriptor_type = ratelimit_pb2.RateLimitDescriptor
    for domain in config.domains.values():
        pending: list[tuple[tuple[Any, ...], Any]] = [((), node) for node in domain.root.nodes()]
        built: list[Any] = []
        while pending and len(built) < limit:
            prefix, node = pending.pop()
            value = "v" if node.value is None else node.value.replace("*", "w")
            entries = (*prefix, descriptor_type.Entry(key=node.key, value=value))
            built.append(descriptor_type(entries=entries))
            pending.extend((entries, child) for child in node.children.nodes())
        for index, descriptor in enumerate(built):
            yield rls_pb2.RateLimitRequest(domain=domain.name, descriptors=[descriptor], hits_addend=index % 3)
        if built:
            yield rls_pb2.RateLimitRequest(domain=domain.name, descriptors=built[:64])


def judge_config(directory: Path) -> dict[str, Any]:
    """Load one config directory and check the outcome (runs in the worker)."""
    from sidecar.config.errors import ConfigError
    from sidecar.config.load import load_config
    from sidecar.limiter.memory import MemoryLimiter
    from sidecar.service import RateLimitService

    problems: list[str] = []
    started = time.monotonic()
    try:
        config = load_config(directory)
    except ConfigError as error:
        files = {str(path) for path in directory.iterdir()}
        for issue in error.issues:
            if issue.file not in files:
                problems.append(f"issue names {issue.file!r}, not the file: {issue}")
            elif issue.line < 1 and not issue.message.startswith("file is larger"):
                problems.append(f"issue without a line: {issue}")
        if not error.issues:
            problems.append("ConfigError without issues")
        return {"outcome": "refused", "problems": problems, "seconds": time.monotonic() - started}
    except Exception as error:
        return {"outcome": "crashed", "problems": [f"{type(error).__name__}: {error}"[:300]], "seconds": 0.0}
    seconds = time.monotonic() - started
    tally = Tally()
    service = RateLimitService(config, MemoryLimiter(max_counters=1000), clock=SteppingClock())
    for request in config_requests(config):
        for repeat in range(2):
            check_call(service, request, tally, f"request {repeat}")
    # INVALID_ARGUMENT is right only for a request breaking a bound (a config key over 256 characters).
    problems += tally.violations
    if tally.outcomes["INTERNAL"] or tally.outcomes["exception"]:
        problems.append(f"accepted, then failed at request time: {tally.summary()}")
    return {"outcome": "accepted", "problems": problems, "seconds": seconds, "requests": tally.cases}


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
