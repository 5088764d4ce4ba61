"""Redis key names of counters (``sidecar.limiter.redis.keys``): collision-free, bounded, one hash tag.

A counter key is the rule identity plus the request's descriptor values, any unicode
(``_ : { } \\n`` included) and up to 4096 characters. The properties: two different
counter keys never share a Redis key; a key's length does not depend on the values;
every key has exactly one Redis Cluster hash tag, ``{digest}``, shared by every window
of the counter; and no value ever appears in a key or in a script argument: values
reach Redis only hashed. In memory, a counter's key holds its values only while they are
short (``counter_key``): long ones are hashed too, so ``--max-counters`` bounds memory.
"""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.config.model import counter_id
from sidecar.limiter.counters import DIGEST_BYTES, HASHED_MARK, MAX_INLINE_CHARS, counter_key, encode_counter
from sidecar.limiter.protocol import Check, Role
from sidecar.limiter.redis.keys import counter_digest, counter_window, window_key
from sidecar.limiter.redis.scripts import decide_arguments
from sidecar.limiter.windows import Unit, window_start

PROPERTY = settings(max_examples=100, deadline=None)
"""Hypothesis' default volume (was 300, three times the CPU): encodings that collide (parts
joined by ``_`` or by nothing) fail the resplit test, long values kept unhashed fail the
bound checks, at 100 examples as at 300; weaker encodings (``NUL``-joined) escaped both."""
PREFIXES = st.sampled_from(["rls", "ratelimit-prod", "a.b_c-d", "x"])
TRICKY = st.sampled_from(["", "_", ":", "{", "}", "{}", "}{", "\n", "\x00", "a_b", "a:b", "{x}", "ü", "\U0001f600"])
VALUES = st.one_of(TRICKY, st.text(max_size=20), st.text(st.sampled_from("_:{}\n\\\"'"), max_size=8))
LONG = st.integers(4000, 4096).map(lambda n: "v" * n)
RULE_IDS = st.builds(
    counter_id,
    st.text(min_size=1, max_size=10),
    st.sampled_from(list(Unit)),
    st.lists(st.tuples(st.text(min_size=1, max_size=6), st.one_of(st.none(), VALUES)), min_size=1, max_size=3),
)
COUNTER_KEYS = st.builds(lambda rule, values: (rule, *values), RULE_IDS, st.lists(st.one_of(VALUES, LONG), max_size=4))
MOMENTS = st.floats(0, 4e9)
UNIT_SECONDS = st.sampled_from([unit.seconds for unit in Unit])
KEY_SHAPE = re.compile(r"(?P<prefix>.+):\{(?P<digest>[0-9a-f]{32})\}:(?P<start>-?[0-9]+)")


def hash_tag(key: str) -> str:
    """The part Redis Cluster hashes: between the first ``{`` and the next ``}``, if non-empty."""
    start = key.find("{")
    if start < 0:
        return key
    end = key.find("}", start + 1)
    return key if end <= start + 1 else key[start + 1 : end]


@st.composite
def resplit(draw: st.DrawFn) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Two different tuples whose parts concatenate, or join with ``_`` or ``:``, to the same
    text: what a joined key would confuse (``a_b`` + ``c`` against ``a`` + ``b_c``)."""
    parts = draw(st.lists(st.text(st.sampled_from("ab_:{}"), max_size=4), min_size=1, max_size=4))
    joiner = draw(st.sampled_from(["", "_", ":"]))
    text = joiner.join(parts)
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=4)))
    other = tuple(text[start:end] for start, end in zip([0, *cuts], [*cuts, len(text)], strict=True))
    first = tuple(parts)
    if other == first:
        other = (*other, "")
    return first, other


@PROPERTY
@given(pair=resplit(), prefix=PREFIXES, unit=UNIT_SECONDS, now=MOMENTS)
def test_resplit_values_never_collide(pair, prefix, unit, now):
    first, second = pair
    assert first != second
    assert encode_counter(first) != encode_counter(second)
    assert counter_window(prefix, first, unit, now)[0] != counter_window(prefix, second, unit, now)[0]


@PROPERTY
@given(first=COUNTER_KEYS, second=COUNTER_KEYS, prefix=PREFIXES, unit=UNIT_SECONDS, now=MOMENTS)
def test_different_counter_keys_get_different_redis_keys(first, second, prefix, unit, now):
    if first == second:
        assert counter_window(prefix, first, unit, now) == counter_window(prefix, second, unit, now)
    else:
        # The encoding is injective (length-prefixed); the digest is 128-bit BLAKE2b.
        assert encode_counter(first) != encode_counter(second)
        assert counter_digest(first) != counter_digest(second)
        assert counter_window(prefix, first, unit, now)[0] != counter_window(prefix, second, unit, now)[0]


@PROPERTY
@given(key=COUNTER_KEYS, prefix=PREFIXES, unit=UNIT_SECONDS, moments=st.lists(MOMENTS, min_size=1, max_size=5))
def test_keys_are_bounded_with_one_shared_hash_tag_and_no_raw_values(key, prefix, unit, moments):
    digest = counter_digest(key)
    assert len(digest) == 2 * DIGEST_BYTES
    names = [counter_window(prefix, key, unit, now)[0] for now in moments]
    # Sync mode names windows with window_key, strict mode with counter_window: the same keys.
    assert names == [window_key(prefix, digest, window_start(now, unit)) for now in moments]
    for name in names:
        shape = KEY_SHAPE.fullmatch(name)
        assert shape is not None and shape["prefix"] == prefix and shape["digest"] == digest, name
        assert name.count("{") == 1 and name.count("}") == 1, name
        assert hash_tag(name) == digest
        # Bounded whatever the values: prefix, 32 hex digits, a Unix time, separators.
        assert len(name) <= len(prefix) + 2 * DIGEST_BYTES + 16
        # Nothing but the prefix, hex digits, digits and separators: no value can be in there.
        assert set(name) <= set(prefix) | set("0123456789abcdef{}:")
    # Sync mode's flush marker (redis_store: ``f"{key}:flushed:{replica}"``) stays in the slot.
    assert hash_tag(f"{names[0]}:flushed:host:123:abcd") == digest


@PROPERTY
@given(
    keys=st.lists(COUNTER_KEYS, min_size=1, max_size=4),
    limits=st.lists(st.integers(0, 2**32 - 1), min_size=4, max_size=4),
    now=MOMENTS,
)
def test_script_arguments_carry_numbers_only(keys, limits, now):
    """Strict mode's ``decide.lua`` gets key names (hashed) and numbers: never a value."""
    checks = [Check(key, 60, limit, 1, Role.ENFORCED) for key, limit in zip(keys, limits, strict=False)]
    windows = [counter_window("rls", check.key, check.unit_seconds, now) for check in checks]
    names, arguments = decide_arguments(
        [name for name, _ in windows], checks, [expires for _, expires in windows], False, {}
    )
    assert all(isinstance(argument, int) for argument in arguments)
    assert all(KEY_SHAPE.fullmatch(name) for name in names)


# -- counter keys in memory: long values hashed (regression: a counter held its values) ------

OVERRIDE_IDS = st.builds(
    lambda domain, unit: f"override\0{domain}\0{unit.seconds}", st.text(max_size=8), st.sampled_from(list(Unit))
)
ANY_RULE_IDS = st.one_of(RULE_IDS, OVERRIDE_IDS)
VALUE_LISTS = st.lists(st.one_of(VALUES, LONG, st.just(HASHED_MARK), st.just("0" * 32)), max_size=4)


@PROPERTY
@given(first=st.tuples(ANY_RULE_IDS, VALUE_LISTS), second=st.tuples(ANY_RULE_IDS, VALUE_LISTS))
def test_counter_keys_are_injective_and_bounded(first, second):
    (rule_a, values_a), (rule_b, values_b) = first, second
    key_a, key_b = counter_key(rule_a, values_a), counter_key(rule_b, values_b)
    assert (key_a == key_b) == ((rule_a, values_a) == (rule_b, values_b))
    assert counter_key(rule_a, list(values_a)) == key_a  # a pure function of its input
    for rule, key in ((rule_a, key_a), (rule_b, key_b)):
        assert not rule.endswith(HASHED_MARK)  # what keeps hashed and plain keys apart
        assert sum(map(len, key[1:])) <= max(MAX_INLINE_CHARS, 2 * DIGEST_BYTES)


@PROPERTY
@given(values=st.lists(st.one_of(VALUES, LONG), min_size=1, max_size=3))
def test_match_descriptor_builds_the_same_counter_keys(values):
    """``match_descriptor`` inlines ``counter_key`` for speed: both must agree."""
    from sidecar.config.load import parse_text
    from sidecar.config.match import match_descriptor

    levels = "".join(
        f"{'    ' * depth}  - key: k{depth}\n{'    ' * depth}    descriptors:\n" for depth in range(len(values) - 1)
    )
    depth = len(values) - 1
    leaf = (
        f"{'    ' * depth}  - key: k{depth}\n{'    ' * depth}    rate_limit: {{unit: second, requests_per_unit: 1}}\n"
    )
    domain, issues = parse_text(f"domain: d\ndescriptors:\n{levels}{leaf}", "k.yaml")
    assert domain is not None, issues

    class Entry:
        def __init__(self, key: str, value: str) -> None:
            self.key, self.value = key, value

    match = match_descriptor(domain, [Entry(f"k{index}", value) for index, value in enumerate(values)])
    assert match is not None
    assert match.key == counter_key(match.rule.counter_id, values)
