"""Broken, hostile and mutated descriptor configs through ``load_config`` (on a temporary directory).

Whatever the bytes, a load must end, quickly, in one of two ways: :class:`ConfigError`
whose every issue names the file and a line (but for the size cap), or a config
that then answers requests built from its own keys and values without INTERNAL or
an exception. Each load runs under a time limit, so a hang fails with its input.
"""

from __future__ import annotations

import copy
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from sidecar.config import yaml_source
from sidecar.config.errors import ConfigError
from sidecar.config.load import load_config
from sidecar.config.model import DescriptorNode, RateLimitConfig

Descriptor = ratelimit_pb2.RateLimitDescriptor
Entry = Descriptor.Entry
FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LOAD_SECONDS = 15.0
"""Far above what any load takes here (the slowest, a few MB, takes about a second)."""
DEMO = (Path(__file__).resolve().parents[2] / "examples" / "config" / "demo.yaml").read_text()
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
BASES = {"demo": DEMO, "rich": RICH}
REPLACEMENTS: list[Any] = [
    None,
    True,
    0,
    -1,
    1.5,
    2**32,
    2**70,
    "",
    "*",
    "second",
    "ü{}\n:_",
    "x" * 300,
    [],
    [1, "a"],
    {},
    {"key": "k"},
    {"x": {"y": [None]}},
]


def note(outcome: str) -> None:
    """A Hypothesis event (``--hypothesis-show-statistics``); nothing outside Hypothesis."""
    if currently_in_test_context():
        event(outcome)


def check_refusal(error: ConfigError, path: Path, data: bytes) -> None:
    assert error.issues, "a ConfigError without issues"
    lines = data.count(b"\n") + 1
    for issue in error.issues:
        assert issue.file == str(path), issue
        assert issue.message, issue
        assert 0 <= issue.line <= lines + 1, issue
        # Every issue points at a line, except the size cap (checked before reading any).
        assert issue.line >= 1 or issue.message.startswith("file is larger"), f"no line: {issue}"
    assert str(error)


def config_requests(config: RateLimitConfig, limit: int = 40) -> Iterator[Any]:
    """Requests built from the config's own descriptors: one per node (its path from the
    root, wildcards filled in), then all of them at once, with assorted hits."""
    for domain in config.domains.values():
        pending: list[tuple[tuple[Any, ...], DescriptorNode]] = [((), node) for node in domain.root.nodes()]
        built = []
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


def exercise(fz: Any, config: RateLimitConfig) -> None:
    """An accepted config must answer requests from its own keys: never INTERNAL."""
    service, _ = fz.make_service(config)
    for request in config_requests(config):
        for _ in range(2):
            response, abort = fz.call(service, request)
            if abort is not None:
                # Only a bound of the request itself (a config key over 256 characters...).
                assert abort.code == grpc.StatusCode.INVALID_ARGUMENT, abort
            else:
                fz.check_response(request, response)
    assert "internal" not in service.stats.errors


def load(fz: Any, data: bytes, seconds: float = LOAD_SECONDS) -> RateLimitConfig | None:
    """Write ``data`` as the only file of a fresh directory and load it; check either outcome."""
    with tempfile.TemporaryDirectory(prefix="config-fuzz-") as directory:
        path = Path(directory) / "rules.yaml"
        path.write_bytes(data)
        try:
            with fz.time_limit(seconds, f"load_config of {data[:80]!r}"):
                config = load_config(directory)
        except ConfigError as error:
            note("refused")
            check_refusal(error, path, data)
            return None
    note("accepted")
    exercise(fz, config)
    return config


# -- field by field: every node of a valid config replaced by every other type --------------


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
    parent[at[-1]] = value
    return changed


def removed(document: Any, at: tuple[Any, ...]) -> Any:
    changed = copy.deepcopy(document)
    parent = changed
    for step in at[:-1]:
        parent = parent[step]
    del parent[at[-1]]
    return changed


def dump(document: Any) -> bytes:
    return yaml.safe_dump(document, sort_keys=False, allow_unicode=True).encode()


@pytest.mark.parametrize("base", list(BASES))
def test_every_field_replaced_by_every_type(fz, base):
    """Also: every field removed, every list item doubled (about 1,000 loads per base)."""
    document = yaml.safe_load(BASES[base])
    assert load(fz, dump(document)) is not None, "the unmutated base must load"
    outcomes = {"accepted": 0, "refused": 0}
    for at in list(locations(document)):
        variants = [replaced(document, at, value) for value in REPLACEMENTS]
        if at:
            variants.append(removed(document, at))
        if at and isinstance(at[-1], int):
            parent = document
            for step in at[:-1]:
                parent = parent[step]
            variants.append(replaced(document, at[:-1], [*parent, parent[at[-1]]]))
        for variant in variants:
            outcome = "accepted" if load(fz, dump(variant)) is not None else "refused"
            outcomes[outcome] += 1
    # Both outcomes must really happen, or the mutations test nothing.
    assert outcomes["accepted"] > 10 and outcomes["refused"] > 100, outcomes


# -- text and bytes -----------------------------------------------------------------------


def mutate_lines(text: str, edits: list[tuple[int, int, str]]) -> str:
    """Line edits: duplicate (duplicate keys!), delete, swap, re-indent, insert text."""
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


YAML_BITS = st.sampled_from(
    (
        *("&a ", "*a", "<<: *a", "- ", ": ", "{", "}", "[", "]", "!!binary ", "!!python/object ", "? ", "|", "'"),
        *('"', "\t", "#", "---", "...", "%YAML 1.1", "~", "0x1F", "1e3", ".nan", "2024-01-01", "*", "key: k", "\\"),
    )
)
LINE_EDITS = st.lists(
    st.tuples(st.integers(0, 4), st.integers(0, 200), st.one_of(YAML_BITS, st.text(max_size=6))),
    min_size=1,
    max_size=5,
)


@FUZZ
@given(base=st.sampled_from(list(BASES)), edits=LINE_EDITS)
def test_line_mutations(fz, base, edits):
    load(fz, mutate_lines(BASES[base], edits).encode("utf-8", "surrogatepass"))


@FUZZ
@given(
    base=st.sampled_from(list(BASES)),
    edits=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5000), st.integers(0, 255)), min_size=1, max_size=8),
)
def test_byte_mutations(fz, base, edits):
    """Flipped, inserted and deleted bytes: non-UTF-8, control characters, broken syntax."""
    data = bytearray(BASES[base].encode())
    for kind, where, byte in edits:
        at = where % (len(data) + 1)
        if kind == 0 and at < len(data):
            data[at] ^= byte or 1
        elif kind == 1:
            data[at:at] = bytes([byte])
        elif kind == 2:
            del data[at : at + 1 + byte % 16]
        else:
            del data[at:]
    load(fz, bytes(data))


@FUZZ
@given(data=st.binary(max_size=2000))
def test_binary_junk(fz, data):
    load(fz, data)


FIELD_NAMES = ["domain", "descriptors", "key", "value", "rate_limit", "unit", "requests_per_unit", "unlimited"]
FIELD_NAMES += ["name", "replaces", "shadow_mode", "quota_mode", "detailed_metric", "share_threshold", "metadata"]
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(),
    st.text(max_size=8),
    st.sampled_from(["second", "minute", "YEAR", "*", "a*b", "premium-*", "demo", ""]),
)
DOCUMENTS = st.recursive(
    SCALARS,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.one_of(st.sampled_from(FIELD_NAMES), st.text(max_size=5)), children, max_size=5),
    ),
    max_leaves=30,
)


@FUZZ
@given(
    domain=st.one_of(st.sampled_from(["d", "demo"]), st.text(max_size=5), SCALARS),
    descriptors=st.lists(DOCUMENTS, max_size=4),
)
def test_structured_documents(fz, domain, descriptors):
    """Config-shaped documents of random types: the parser's type checks at every field."""
    load(fz, dump({"domain": domain, "descriptors": descriptors}))


# -- hostile files ------------------------------------------------------------------------


def laughs(levels: int, width: int) -> str:
    """Billion laughs: each level a list of ``width`` aliases of the previous one."""
    lines = ["domain: d", "metadata:", "  l0: &l0 [lol]"]
    for level in range(1, levels):
        lines.append(f"  l{level}: &l{level} [{', '.join([f'*l{level - 1}'] * width)}]")
    return "\n".join(lines) + "\n"


def descriptor_laughs(levels: int, width: int) -> str:
    """Aliases in ``descriptors``: the parser walked each reference (16^8 walks, a hang)."""
    lines = ["domain: d", "metadata:", "  l0: &l0 {key: k, rate_limit: {unit: second, requests_per_unit: 1}}"]
    for level in range(1, levels):
        lines.append(f"  l{level}: &l{level} {{key: k, descriptors: [{', '.join([f'*l{level - 1}'] * width)}]}}")
    lines.append(f"descriptors: [{', '.join([f'*l{levels - 1}'] * width)}]")
    return "\n".join(lines) + "\n"


def merge_bomb(levels: int) -> str:
    """Nested merge keys, each doubling: PyYAML copies them while flattening, before any
    node is counted (40 levels: 2^40 pairs, out of memory; the file is 1 KB)."""
    node = "&a0 {x: 1, y: 2}"
    for level in range(1, levels):
        node = f"&a{level} {{<<: [{node}, *a{level - 1}]}}"
    return f"domain: d\nmetadata: {node}\n"


VALID = "domain: huge\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n"
HOSTILE: dict[str, bytes] = {
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
    "over the size cap": (VALID + "# " + "x" * (9 * 1024 * 1024) + "\n").encode(),
    "a long line": (VALID + "metadata: " + "x" * 2_000_000 + "\n").encode(),
    "a huge value": VALID.replace("key: k", "key: k\n    value: " + "v" * 1_000_000).encode(),
    "many unknown fields": (VALID + "".join(f"x{n}: {n}\n" for n in range(20_000))).encode(),
}
ACCEPTED = {"bom then valid", "a long line", "a huge value"}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_files(fz, name):
    started = time.monotonic()
    config = load(fz, HOSTILE[name])
    assert (config is not None) == (name in ACCEPTED), name
    assert time.monotonic() - started < 10


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("billion laughs", laughs(10, 10)),
        ("laughs in descriptors", descriptor_laughs(8, 16)),
        ("merge bomb", merge_bomb(40)),
        ("recursive alias", "domain: d\nmetadata: &a [*a]\n"),
    ],
)
def test_alias_bombs_are_refused_with_a_line(fz, name, text):
    """Regression: descriptor laughs hung (the parser walked every alias reference: 16^8
    descriptors) and the merge bomb ran out of memory (PyYAML's merge flattening doubles per
    level before any node is counted); now every alias counts its expanded size."""
    with tempfile.TemporaryDirectory() as directory:
        (Path(directory) / "bomb.yaml").write_text(text)
        with fz.time_limit(5, name), pytest.raises(ConfigError) as refused:
            load_config(directory)
    (issue,) = refused.value.issues
    assert issue.line >= 1
    assert "alias" in issue.message


def test_aliases_within_the_bound_still_work(fz):
    """Reusing a subtree through an alias is legitimate YAML and stays accepted."""
    text = """\
        domain: d
        metadata:
          per_user: &per_user
            - key: user
              rate_limit: {unit: minute, requests_per_unit: 5}
        descriptors:
          - key: a
            descriptors: *per_user
          - key: b
            descriptors: *per_user
    """
    config = load(fz, "\n".join(line[8:] for line in text.splitlines()).encode())
    assert config is not None
    assert len(config.domains["d"].rules) == 2


def test_a_flat_node_flood_stops_at_the_node_cap_while_composing(fz, monkeypatch):
    """Regression: nodes were counted only once composed, so 8 MiB of ``[1,1,1,...]`` built
    four million node objects (gigabytes, a minute) before any count. With the cap lowered
    the same path is checked in milliseconds."""
    monkeypatch.setattr(yaml_source, "MAX_NODES", 2_000)
    started = time.monotonic()
    text = "domain: d\nmetadata: [" + "1, " * 1_000_000 + "]\n"
    assert load(fz, text.encode()) is None
    assert time.monotonic() - started < 2
