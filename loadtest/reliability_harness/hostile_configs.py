"""Hostile configs: field swaps, line and byte mutations, random documents, hostile files, and the checks.

Shared by the reliability report's bad-input scenario (``bad_input.py``: :func:`config_cases`,
seeded) and ``tests/fuzz/test_config_fuzz.py`` (Hypothesis draws the edits). A refused
config must name the file and a line (:func:`refusal_problems`); an accepted one must answer
requests built from its own descriptors (:func:`exercise`).
"""

from __future__ import annotations

import copy
import functools
import random
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import yaml

from loadtest.reliability_harness.bounds_oracle import outcome_problem
from loadtest.reliability_harness.hostile_requests import (
    MIB,
    Descriptor,
    Entry,
    mutate,
    pick,
    random_edits,
    random_text,
)
from loadtest.reliability_harness.in_process import EXAMPLES, call, make_service
from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2

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
        if issue.line < 1 and not issue.message.startswith("file is "):
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
