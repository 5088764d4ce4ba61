"""Hostile requests: random, mutated, invalid UTF-8, raw wire payloads, and how to send them.

Seeded ``random`` for the reliability report's bad-input scenario (``bad_input.py``); the
fuzz tests (``tests/fuzz``) draw the same edit lists with Hypothesis and the raw-bytes
test (``tests/tools/test_bad_input.py``) sends :func:`raw_payloads`. What an answer must
be is :mod:`loadtest.reliability_harness.bounds_oracle`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import grpc

from loadtest.reliability_harness.bounds_oracle import UINT32_MAX, UINT64_MAX
from sidecar.protos.envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2

MIB = 1024 * 1024
INT32 = (-(2**31), 2**31 - 1)
MAX_MESSAGE_BYTES = MIB
"""The sidecar's gRPC receive cap: a bigger message is RESOURCE_EXHAUSTED before any parsing."""
RSS_GROWTH_LIMIT = 50 * MIB
"""What the sidecar may gain over a raw-bytes run (warm-up excluded): buffers and caches,
not a per-call leak (20,000 calls leaking 2.5 kB each would pass it)."""
Descriptor = ratelimit_pb2.RateLimitDescriptor
Entry = Descriptor.Entry
Override = Descriptor.RateLimitOverride

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
