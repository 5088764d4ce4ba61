"""Hostile input for the sidecar and the checks on what it makes of it: one home for both sides.

Shared by the bad-input scenario of the reliability report (``bad_input.py``: seeded
``random``, bounded in time) and the tests (``tests/fuzz``: Hypothesis strategies drawing
the edit lists these functions take; ``tests/tools/test_bad_input.py``: the raw
payloads). Plain data and functions only:

* the fuzz config (``examples/config`` plus :data:`FUZZ_RULES`) and the handler driven
  in-process without an event loop (:func:`make_service`, :func:`call`);
* the invariants, as functions naming what is wrong (None or ``[]`` when nothing is), so a
  test asserts on them and the harness counts them: :func:`outcome_problem`,
  :func:`refusal_problems`, :func:`exercise`, :func:`expected_codes`;
* requests, random (:func:`random_request`) and mutated (:func:`mutate`,
  :func:`with_invalid_utf8`), raw wire payloads (:func:`raw_payloads`) and how to send them;
* configs: field swaps, line and byte mutations, random documents, hostile files.

``sidecar`` is imported inside the functions: ``python -m reliability_harness.bad_input``
puts the checkout on ``sys.path`` only when ``support`` is imported.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import random
import re
import signal
import threading
import time
from collections.abc import Callable, Coroutine, Iterable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import grpc
import yaml
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "config"
MIB = 1024 * 1024
UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
INT32 = (-(2**31), 2**31 - 1)
KNOWN_UNITS = frozenset(range(1, 8))
"""``RateLimitResponse.RateLimit.Unit`` SECOND to YEAR."""
LONGEST_WINDOW = 365 * 86_400
MAX_MESSAGE_BYTES = MIB
"""The sidecar's gRPC receive cap: a bigger message is RESOURCE_EXHAUSTED before any parsing."""
RSS_GROWTH_LIMIT = 50 * MIB
"""What the sidecar may gain over a raw-bytes run (warm-up excluded): buffers and caches,
not a per-call leak (20,000 calls leaking 2.5 kB each would pass it)."""
OK = rls_pb2.RateLimitResponse.OK
OVER_LIMIT = rls_pb2.RateLimitResponse.OVER_LIMIT
Descriptor = ratelimit_pb2.RateLimitDescriptor
Entry = Descriptor.Entry
Override = Descriptor.RateLimitOverride

# ---------------------------------------------------------------------------------
# The fuzz config and the handler, in-process
# ---------------------------------------------------------------------------------

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
  - key: "ünï{c}:_ key"
    value: "x\\ty{}"
    rate_limit: {unit: second, requests_per_unit: 1}
"""
CONFIG_KEYS = (
    *("remote_address", "generic_key", "api_key", "header_match", "k", "zero", "max", "shared"),
    *("quota", "shadow", "detailed", "inner", "free", "ünï{c}:_ key"),
)
"""Keys of the fuzz config, so requests reach real rules."""
CONFIG_VALUES = (
    *("", "api", "login", "write", "premium-1", "internal-monitoring", "p-1", "aaab", "x\ty{}"),
    *("a" * 4095 + "b", "a" * 4096, "\x00", "{}\n:_"),
)
GIANT_LENGTHS = (257, 4096, 4097, 70_000)
"""Lengths of giant strings: just past the 256 and 4096 character bounds, and far past."""
ODD_UNITS = (0, 8, 99, -1, *INT32)
"""Override units outside SECOND..YEAR."""
ENTRY_REPEATS = (0, 32, 33, 500)
DESCRIPTOR_REPEATS = (0, 64, 65, 1000)
"""How many times one small entry or descriptor is repeated: around the bounds (32, 64)."""


@functools.cache
def fuzz_config() -> Any:
    """``examples/config`` plus :data:`FUZZ_RULES` (immutable, so loaded once)."""
    from sidecar.config.load import load_config, parse_text
    from sidecar.config.model import RateLimitConfig

    example = load_config(EXAMPLES)
    domain, issues = parse_text(FUZZ_RULES, "fuzz.yaml")
    if domain is None:
        raise RuntimeError(f"the fuzz rules do not load: {issues}")
    return RateLimitConfig({**example.domains, domain.name: domain}, (*example.files, "fuzz.yaml"), "fuzz")


class SteppingClock:
    """A clock the caller moves: ``clock()`` returns ``clock.now``."""

    def __init__(self, now: float = 1_700_000_000.25) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_service(config: Any, max_counters: int = 1000, clock: SteppingClock | None = None) -> tuple[Any, Any]:
    """``(RateLimitService, MemoryLimiter)`` for ``config``."""
    from sidecar.limiter.memory import MemoryLimiter
    from sidecar.service.servicer import RateLimitService

    limiter = MemoryLimiter(max_counters=max_counters)
    return RateLimitService(config, limiter, clock=clock or SteppingClock()), limiter


class AbortedError(Exception):
    """What :class:`AbortingContext` raises in place of gRPC's abort."""

    def __init__(self, code: Any, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details


class AbortingContext:
    """Enough of a ``ServicerContext`` for the handler."""

    async def abort(self, code: Any, details: str) -> None:
        raise AbortedError(code, details)


def drive(coroutine: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine that never suspends (the handler on the memory backend) to its end:
    one ``send(None)``, so a call costs microseconds and needs no event loop."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise RuntimeError("the handler suspended; on the memory backend it never should")


def call(service: Any, request: Any) -> tuple[Any, AbortedError | None]:
    """``(response, None)`` or ``(None, abort)``; any other exception propagates."""
    try:
        return drive(service.ShouldRateLimit(request, AbortingContext())), None
    except AbortedError as abort:
        return None, abort


class TimeLimitExceeded(BaseException):
    """Raised by :func:`time_limit`; a BaseException so no ``except Exception`` in the code under test swallows it."""


@contextlib.contextmanager
def time_limit(seconds: float, what: str) -> Iterator[None]:
    """Raise :class:`TimeLimitExceeded` in the block once it runs longer than ``seconds``.

    SIGALRM, so in the main thread only (elsewhere the block runs unbounded). A timer
    already set (pytest-timeout's) is put back, minus the time spent here.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expired(signum: int, frame: FrameType | None) -> None:
        raise TimeLimitExceeded(f"{what}: still running after {seconds} s")

    previous_handler = signal.signal(signal.SIGALRM, expired)
    previous_delay, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    started = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous_handler)
        if previous_delay:
            signal.setitimer(signal.ITIMER_REAL, max(0.001, previous_delay - (time.monotonic() - started)))


# ---------------------------------------------------------------------------------
# What every call must end in
# ---------------------------------------------------------------------------------

REFUSAL_DETAILS = re.compile(r"(domain|descriptors|request)\b")
"""How an INVALID_ARGUMENT's details start: the part of the request at fault."""


def bound_broken(request: Any) -> bool:
    """README "Request bounds", written independently of ``sidecar.service.validate``."""
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


def response_problems(request: Any, response: Any) -> Iterator[str]:
    """What is wrong with an answer (the handler's wire bytes): one status per descriptor, codes
    and numbers in range."""
    parsed = rls_pb2.RateLimitResponse.FromString(response)
    if parsed.overall_code not in (OK, OVER_LIMIT):
        yield f"overall_code {parsed.overall_code}"
    if len(parsed.statuses) != len(request.descriptors):
        yield f"{len(parsed.statuses)} statuses for {len(request.descriptors)} descriptors"
    for index, status in enumerate(parsed.statuses):
        if status.code not in (OK, OVER_LIMIT):
            yield f"statuses[{index}].code {status.code}"
        if not 0 <= status.limit_remaining <= UINT32_MAX:
            yield f"statuses[{index}].limit_remaining {status.limit_remaining}"
        if status.HasField("current_limit") and (
            status.current_limit.unit not in KNOWN_UNITS
            or status.limit_remaining > status.current_limit.requests_per_unit
        ):
            yield f"statuses[{index}]: remaining {status.limit_remaining} of {status.current_limit}"
        if status.HasField("duration_until_reset") and not 1 <= status.duration_until_reset.seconds <= LONGEST_WINDOW:
            yield f"statuses[{index}].duration_until_reset {status.duration_until_reset.seconds} s"
    if parsed.overall_code == OVER_LIMIT and not any(status.code == OVER_LIMIT for status in parsed.statuses):
        yield "OVER_LIMIT overall with no descriptor OVER_LIMIT"


def response_problem(request: Any, response: Any) -> str | None:
    """The first of :func:`response_problems`, or None."""
    return next(response_problems(request, response), None)


def outcome_problem(request: Any, response: Any, abort: AbortedError | None) -> str | None:
    """What is wrong with how a call ended, or None: INVALID_ARGUMENT naming the part at fault
    exactly when the request breaks a bound (``request`` None: bytes that are no message),
    else a valid answer."""
    if abort is not None:
        if abort.code != grpc.StatusCode.INVALID_ARGUMENT:
            return f"{abort.code.name}: {abort.details}"
        if not REFUSAL_DETAILS.match(abort.details):
            return f"refused with details naming no part of the request: {abort.details!r}"
        if request is not None and not bound_broken(request):
            return f"a valid request was refused: {abort.details}"
        return None
    if request is None or bound_broken(request):
        return "a request breaking a bound was answered"
    return response_problem(request, response)


# ---------------------------------------------------------------------------------
# Requests: random, mutated, invalid UTF-8, raw bytes
# ---------------------------------------------------------------------------------

ALPHABETS = (
    "abcxyz019",
    "_:{}\n\t\\\"' ",
    "".join(map(chr, range(0x20, 0x7F))),
    "äöüßжя中文ü\u200b\ufeff\U0001f600\U0010fffd",
)
INVALID_UTF8 = (b"\xff", b"\x80", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe2\x82", b"\xfe\xfe\xff")
PLACEHOLDER = "Qz9Qz9Qz9"
STRING_FIELDS = ("domain", "key", "value")


def random_text(rng: random.Random, longest: int = 12) -> str:
    """Unicode without lone surrogates (protobuf strings are UTF-8), often with separators."""
    alphabet = rng.choice(ALPHABETS)
    if rng.random() < 0.1:
        return "".join(
            chr(rng.choice([rng.randrange(0x20, 0xD800), rng.randrange(0xE000, 0x110000)])) for _ in range(4)
        )
    return "".join(rng.choice(alphabet) for _ in range(rng.randrange(longest + 1)))


def giant_text(rng: random.Random) -> str:
    return rng.choice("xж\U0001f600") * rng.choice(GIANT_LENGTHS)


def pick(rng: random.Random, *choices: Callable[[], Any]) -> Any:
    """One of ``choices`` (callables), called."""
    return rng.choice(choices)()


def random_request(rng: random.Random, wild: bool | None = None) -> Any:
    """Half wild (any domain, 0 to 1000 descriptors of anything), half plausible
    (the config's domains and keys, numbers in range), so answers and refusals are many."""
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
        return Entry(key=key, value=value)

    def descriptor(small: bool) -> Any:
        if not wild:
            entries = [entry(True)] * 32 if rng.random() < 0.05 else [entry(True) for _ in range(rng.randint(1, 3))]
        elif small or rng.random() < 0.7:
            entries = [entry(small) for _ in range(rng.randint(0, 4))]
        else:
            entries = [entry(True)] * rng.choice(ENTRY_REPEATS)
        built = Descriptor(entries=entries)
        if rng.random() < 0.25:
            unit = rng.choice([*ODD_UNITS, *range(1, 8)]) if wild else rng.randint(1, 7)
            requests = rng.choice([0, 1, UINT32_MAX, rng.randrange(UINT32_MAX + 1)])
            built.limit.CopyFrom(Override(requests_per_unit=requests, unit=unit))
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
            descriptors = [descriptor(True)] * rng.choice(DESCRIPTOR_REPEATS)
    else:
        domain = rng.choice(["demo", "fuzz"])
        if rng.random() < 0.1:
            descriptors = [descriptor(False)] * 64
        else:
            descriptors = [descriptor(False) for _ in range(rng.randint(1, 5))]
    hits = rng.choice([0, 0, 1, UINT32_MAX, rng.randrange(UINT32_MAX + 1)])
    return rls_pb2.RateLimitRequest(domain=domain, descriptors=descriptors, hits_addend=hits)


def mutate(data: bytes, edits: Iterable[tuple[int, int, int]]) -> bytes:
    """Byte edits ``(kind, where, byte)``, positions taken modulo the length: kind 0 flips,
    1 inserts, 2 deletes a few, 3 truncates, 4 duplicates a run."""
    buffer = bytearray(data)
    for kind, where, byte in edits:
        at = where % (len(buffer) + 1)
        if kind == 0 and at < len(buffer):
            buffer[at] ^= byte or 1
        elif kind == 1:
            buffer[at:at] = bytes([byte])
        elif kind == 2:
            del buffer[at : at + 1 + byte % 16]
        elif kind == 3:
            del buffer[at:]
        else:
            buffer[at:at] = buffer[at : at + 1 + byte]
    return bytes(buffer)


def random_edits(rng: random.Random, most: int = 6) -> list[tuple[int, int, int]]:
    """1 to ``most`` edits for :func:`mutate`."""
    return [(rng.randrange(5), rng.randrange(1 << 20), rng.randrange(256)) for _ in range(rng.randint(1, most))]


def with_invalid_utf8(request: Any, field: str, bad: bytes, index: int) -> bytes | None:
    """``request`` serialized with ``bad`` bytes in one string field: the domain, or ``field``
    of entry ``index`` (modulo their count). Python cannot build such a message, so a
    placeholder's bytes are swapped on the wire (same length: no length prefix changes).
    None when there is no such entry or the placeholder is not found exactly once."""
    if field == "domain":
        request.domain = PLACEHOLDER
    else:
        entries = [entry for descriptor in request.descriptors for entry in descriptor.entries]
        if not entries:
            return None
        setattr(entries[index % len(entries)], field, PLACEHOLDER)
    data: bytes = request.SerializeToString()
    if data.count(PLACEHOLDER.encode()) != 1:
        return None
    return data.replace(PLACEHOLDER.encode(), (bad + b"a" * len(PLACEHOLDER))[: len(PLACEHOLDER)])


def random_invalid_utf8(rng: random.Random, request: Any) -> bytes | None:
    """:func:`with_invalid_utf8` with a random field, byte sequence and entry."""
    return with_invalid_utf8(request, rng.choice(STRING_FIELDS), rng.choice(INVALID_UTF8), rng.randrange(1 << 16))


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
            yield mutate(random_request(rng, wild=False).SerializeToString(), random_edits(rng))
        elif kind == 2:
            yield random_invalid_utf8(rng, random_request(rng)) or b"\x0a\x01\xff"
        else:
            yield random_request(rng).SerializeToString()


def expected_codes(payload: bytes) -> set[grpc.StatusCode]:
    """The codes a raw payload may get: RESOURCE_EXHAUSTED over the size cap, else OK or INVALID_ARGUMENT."""
    if len(payload) > MAX_MESSAGE_BYTES:
        return {grpc.StatusCode.RESOURCE_EXHAUSTED}
    return {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}


def send_raw(method: Any, payloads: Iterable[bytes], in_flight: int) -> Iterator[tuple[bytes, grpc.StatusCode]]:
    """Each payload and the code it got, through ``method`` (a unary call with identity
    serializers: the bytes go out as they are), ``in_flight`` calls pending at most."""
    pending: list[tuple[bytes, Any]] = []

    def settle(payload: bytes, future: Any) -> tuple[bytes, grpc.StatusCode]:
        try:
            future.result()
        except grpc.RpcError as error:
            return payload, error.code()
        return payload, grpc.StatusCode.OK

    for payload in payloads:
        pending.append((payload, method.future(payload, timeout=10.0)))
        if len(pending) >= in_flight:
            yield settle(*pending.pop(0))
    for payload, future in pending:
        yield settle(payload, future)


# ---------------------------------------------------------------------------------
# Configs: field swaps, mutations, random documents, hostile files, and the checks
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
        rate_limit:
          name: premium
          unit: hour
          requests_per_unit: 100
          replaces: [{name: api}]
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
"""What every node of a valid config is replaced by in turn: every other type."""
YAML_BITS = (
    *("&a ", "*a", "<<: *a", "- ", ": ", "{", "}", "[", "]", "!!binary ", "!!python/object ", "? ", "|", "'", '"'),
    *("\t", "#", "---", "...", "%YAML 1.1", "~", "0x1F", "1e3", ".nan", "2024-01-01", "*", "key: k", "\\", "\x00"),
)
"""YAML syntax to insert into lines."""
FIELD_NAMES = (
    *("domain", "descriptors", "key", "value", "rate_limit", "unit", "requests_per_unit", "unlimited", "name"),
    *("replaces", "shadow_mode", "quota_mode", "detailed_metric", "share_threshold", "metadata"),
)
VALID = "domain: huge\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n"


@functools.cache
def base_configs() -> dict[str, str]:
    """The valid configs the mutations start from: ``examples/config/demo.yaml`` and :data:`RICH`."""
    return {"demo": (EXAMPLES / "demo.yaml").read_text(), "rich": RICH}


def dump(document: Any) -> bytes:
    return yaml.safe_dump(document, sort_keys=False, allow_unicode=True).encode()


def locations(node: Any, at: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """The path of every node of a document, the root's ``()`` first."""
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
    parent[at[-1]] = value
    return changed


def removed(document: Any, at: tuple[Any, ...]) -> Any:
    changed = copy.deepcopy(document)
    parent = changed
    for step in at[:-1]:
        parent = parent[step]
    del parent[at[-1]]
    return changed


def field_variants(document: Any) -> Iterator[Any]:
    """Every node replaced by every one of :data:`REPLACEMENTS`, every node removed, every
    list item doubled."""
    for at in list(locations(document)):
        for value in REPLACEMENTS:
            yield replaced(document, at, value)
        if at:
            yield removed(document, at)
        if at and isinstance(at[-1], int):
            parent = document
            for step in at[:-1]:
                parent = parent[step]
            yield replaced(document, at[:-1], [*parent, parent[at[-1]]])


def mutate_lines(text: str, edits: Iterable[tuple[int, int, str]]) -> str:
    """Line edits ``(kind, where, payload)``: 0 duplicates a line (duplicate keys!), 1 deletes
    it, 2 swaps it with the next, 3 re-indents it, 4 inserts ``payload`` into it."""
    lines = text.splitlines()
    for kind, where, payload in edits:
        if not lines:
            break
        at = where % len(lines)
        if kind == 0:
            lines.insert(at, lines[at])
        elif kind == 1:
            del lines[at]
        elif kind == 2:
            other = (at + 1) % len(lines)
            lines[at], lines[other] = lines[other], lines[at]
        elif kind == 3:
            lines[at] = " " * (len(payload) % 7) + lines[at].lstrip()
        else:
            column = len(payload) % (len(lines[at]) + 1)
            lines[at] = lines[at][:column] + payload + lines[at][column:]
    return "\n".join(lines) + "\n"


def random_line_edits(rng: random.Random) -> list[tuple[int, int, str]]:
    """1 to 5 edits for :func:`mutate_lines`, inserting :data:`YAML_BITS` or short text."""
    return [
        (
            rng.randrange(5),
            rng.randrange(1 << 16),
            pick(rng, lambda: rng.choice(YAML_BITS), lambda: random_text(rng, 6)),
        )
        for _ in range(rng.randint(1, 5))
    ]


def random_document(rng: random.Random, depth: int = 0) -> Any:
    """Scalars, lists and mappings (often keyed by :data:`FIELD_NAMES`), three levels at most."""
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
    """Billion laughs: each level a list of ``width`` aliases of the previous one."""
    lines = ["domain: d", "metadata:", "  l0: &l0 [lol]"]
    lines += [f"  l{n}: &l{n} [{', '.join([f'*l{n - 1}'] * width)}]" for n in range(1, levels)]
    return "\n".join(lines) + "\n"


def descriptor_laughs(levels: int, width: int) -> str:
    """Aliases in ``descriptors``: the parser walked each reference (16^8 walks, a hang)."""
    lines = ["domain: d", "metadata:", "  l0: &l0 {key: k, rate_limit: {unit: second, requests_per_unit: 1}}"]
    lines += [f"  l{n}: &l{n} {{key: k, descriptors: [{', '.join([f'*l{n - 1}'] * width)}]}}" for n in range(1, levels)]
    lines.append(f"descriptors: [{', '.join([f'*l{levels - 1}'] * width)}]")
    return "\n".join(lines) + "\n"


def merge_bomb(levels: int) -> str:
    """Nested merge keys, each doubling: PyYAML copies them while flattening, before any
    node is counted (40 levels: 2^40 pairs, out of memory; the file is 1 KB)."""
    node = "&a0 {x: 1, y: 2}"
    for level in range(1, levels):
        node = f"&a{level} {{<<: [{node}, *a{level - 1}]}}"
    return f"domain: d\nmetadata: {node}\n"


def flat_node_flood(items: int) -> str:
    """A flat list of ``items`` scalars: nodes were counted only once composed (8 MiB of
    them built four million node objects, gigabytes, before any count)."""
    return "domain: d\nmetadata: [" + "1, " * items + "]\n"


@functools.cache
def hostile_files() -> dict[str, bytes]:
    """Empty, binary, odd encodings, YAML tags, duplicate keys, bombs, deep nesting, huge."""
    return {
        "empty": b"",
        "blank": b"  \n\n\t\n",
        "comments only": b"# nothing\n# here\n",
        "document marker only": b"---\n",
        "two documents": (VALID + "---\n" + VALID).encode(),
        "a bare scalar": b"just text",
        "a list": b"- a\n- b\n",
        "null bytes": VALID.encode().replace(b"huge", b"hu\x00ge"),
        "invalid utf-8": VALID.encode().replace(b"huge", b"hu\xffge"),
        "utf-16": VALID.encode("utf-16"),
        "bom then valid": b"\xef\xbb\xbf" + VALID.encode(),
        "tab indentation": VALID.replace("  - key", "\t- key").encode(),
        "duplicate domain key": (VALID + "domain: again\n").encode(),
        "duplicate nested key": VALID.replace("unit: second,", "unit: second, unit: minute,").encode(),
        "duplicate through a merge": b"domain: d\nbase: &b {key: k}\ndescriptors:\n  - {<<: *b, key: j}\n",
        "python tags": b"domain: !!python/object/apply:os.system ['true']\n",
        "binary tag": b"domain: !!binary aGVsbG8=\n",
        "set and omap": b"domain: !!set {a, b}\ndescriptors: !!omap [a: 1]\n",
        "complex key": b"? [a, b]\n: 1\ndomain: d\n",
        "mapping as key": b"{a: 1}: 2\n",
        "undefined alias": b"domain: *nowhere\n",
        "recursive alias": b"domain: d\nmetadata: &a [*a]\n",
        "recursive descriptors": b"domain: d\ndescriptors: &d [{key: k, descriptors: *d}]\n",
        "self-containing root": b"&r {domain: d, metadata: *r}\n",
        "deep flow sequences": b"[" * 100_000 + b"]" * 100_000,
        "deep flow mappings": b"{a: " * 50_000 + b"1" + b"}" * 50_000,
        "deep block mappings": "".join(" " * depth + "a:\n" for depth in range(3000)).encode(),
        "deep block sequences": "".join(" " * depth + "-\n" for depth in range(3000)).encode(),
        "deep descriptors": (
            "domain: d\ndescriptors:\n"
            + "".join(" " * (4 * depth) + "- key: k\n" + " " * (4 * depth) + "  descriptors:\n" for depth in range(40))
        ).encode(),
        "billion laughs": laughs(10, 10).encode(),
        "laughs in descriptors": descriptor_laughs(8, 16).encode(),
        "merge bomb": merge_bomb(40).encode(),
        "over the size cap": (VALID + "# " + "x" * (9 * MIB) + "\n").encode(),
        "a long line": (VALID + "metadata: " + "x" * 2_000_000 + "\n").encode(),
        "a huge value": VALID.replace("key: k", "key: k\n    value: " + "v" * 1_000_000).encode(),
        "many unknown fields": (VALID + "".join(f"x{n}: {n}\n" for n in range(20_000))).encode(),
    }


ACCEPTED_HOSTILE = frozenset({"bom then valid", "a long line", "a huge value"})
"""The hostile files that are valid configs after all."""
SLOW_HOSTILE = frozenset({"deep flow sequences", "a long line", "a huge value", "many unknown fields"})
"""The hostile files taking a quarter second or more to load: the harness tries them in full runs only."""


def config_cases(seed: int, count: int, quick: bool) -> list[bytes]:
    """``count`` configs (at least the hostile files; quick: without the slow ones; full: with
    an 8 MiB flat node flood): a third field variants (sampled), the rest line and byte
    mutations, random documents and binary junk."""
    rng = random.Random(seed)
    hostile = [data for name, data in hostile_files().items() if not (quick and name in SLOW_HOSTILE)]
    if not quick:
        hostile.append(flat_node_flood(8 * MIB // 3 - 20).encode())
    bases = list(base_configs().values())
    swaps = [dump(variant) for base in bases for variant in field_variants(yaml.safe_load(base))]
    rest = max(0, count - len(hostile))
    chosen = rng.sample(swaps, min(len(swaps), rest // 3))
    while len(chosen) < rest:
        kind = len(chosen) % 4
        if kind == 0:
            chosen.append(mutate_lines(rng.choice(bases), random_line_edits(rng)).encode())
        elif kind == 1:
            chosen.append(mutate(rng.choice(bases).encode(), random_edits(rng)))
        elif kind == 2:
            chosen.append(dump({"domain": random_document(rng), "descriptors": random_document(rng)}))
        else:
            chosen.append(rng.randbytes(rng.randrange(2000)))
    return hostile + chosen


def refusal_problems(error: Any, path: Path, data: bytes) -> list[str]:
    """What is wrong with a ``ConfigError`` for the file ``path`` holding ``data``: every issue
    must name the file and a line in it (all but the size cap, checked before reading any)."""
    problems = [] if error.issues else ["a ConfigError without issues"]
    lines = data.count(b"\n") + 1
    for issue in error.issues:
        if issue.file != str(path):
            problems.append(f"issue names {issue.file!r}, not the file: {issue}")
        if not issue.message:
            problems.append(f"issue without a message: {issue!r}")
        if not 0 <= issue.line <= lines + 1:
            problems.append(f"issue names line {issue.line} of {lines}: {issue}")
        if issue.line < 1 and not issue.message.startswith("file is larger"):
            problems.append(f"issue without a line: {issue}")
    if not str(error):
        problems.append("a ConfigError that says nothing")
    return problems


def config_requests(config: Any, limit: int = 40) -> Iterator[Any]:
    """Requests built from the config's own descriptors: one per node (its path from the
    root, wildcards filled in), then all of them at once, with assorted hits."""
    for domain in config.domains.values():
        pending: list[tuple[tuple[Any, ...], Any]] = [((), node) for node in domain.root.nodes()]
        built: list[Any] = []
        while pending and len(built) < limit:
            prefix, node = pending.pop()
            value = "v" if node.value is None else node.value.replace("*", "w")
            entries = (*prefix, Entry(key=node.key, value=value))
            built.append(Descriptor(entries=entries))
            pending.extend((entries, child) for child in node.children.nodes())
        for index, descriptor in enumerate(built):
            yield rls_pb2.RateLimitRequest(domain=domain.name, descriptors=[descriptor], hits_addend=index % 3)
        if built:
            yield rls_pb2.RateLimitRequest(domain=domain.name, descriptors=built[:64])


def exercise(config: Any) -> list[str]:
    """What goes wrong when an accepted config answers requests from its own keys (each
    twice): INVALID_ARGUMENT only for a bound of the request itself (a config key over 256
    characters), never INTERNAL. Other exceptions propagate."""
    service, _ = make_service(config)
    problems = []
    for request in config_requests(config):
        for repeat in range(2):
            response, abort = call(service, request)
            problem = outcome_problem(request, response, abort)
            if problem is not None:
                problems.append(f"{request.domain!r} request {repeat}: {problem}"[:300])
    if "internal" in service.stats.errors:
        problems.append(f"internal errors: {service.stats.errors}")
    return problems
