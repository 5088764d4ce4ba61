"""Broken, hostile and mutated descriptor configs through ``load_config`` (on a temporary directory).

Whatever the bytes, a load must end, quickly, in one of two ways: :class:`ConfigError`
whose every issue names the file and a line (but for the size cap), or a config
that then answers requests built from its own keys and values without INTERNAL or
an exception. Each load runs under a time limit, so a hang fails with its input.

The base configs, mutators, hostile files and both checks are shared with the
reliability report (``loadtest/reliability_harness/hostile_configs.py``); the edits are drawn here.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from loadtest.reliability_harness.hostile_configs import (
    ACCEPTED_HOSTILE,
    FIELD_NAMES,
    YAML_BITS,
    base_configs,
    dump,
    exercise,
    field_variants,
    flat_node_flood,
    hostile_files,
    mutate_lines,
    refusal_problems,
)
from loadtest.reliability_harness.hostile_requests import mutate
from sidecar.config import yaml_source
from sidecar.config.errors import ConfigError
from sidecar.config.load import load_config
from sidecar.config.model import RateLimitConfig

FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LOAD_SECONDS = 15.0
"""Far above what any load takes here (the slowest, a few MB, takes about a second)."""
BASES = base_configs()
HOSTILE = hostile_files()


def note(outcome: str) -> None:
    """A Hypothesis event (``--hypothesis-show-statistics``); nothing outside Hypothesis."""
    if currently_in_test_context():
        event(outcome)


def load(fz: Any, data: bytes, directory: Path | None = None) -> RateLimitConfig | None:
    """Write ``data`` as the only file of ``directory`` (else a fresh one) and load it; check
    either outcome: a refusal naming the file and a line, or a config answering requests
    from its own keys."""
    if directory is None:
        with tempfile.TemporaryDirectory(prefix="config-fuzz-") as fresh:
            return load(fz, data, Path(fresh))
    path = directory / "rules.yaml"
    path.write_bytes(data)
    try:
        with fz.time_limit(LOAD_SECONDS, f"load_config of {data[:80]!r}"):
            config = load_config(directory)
    except ConfigError as error:
        note("refused")
        problems = refusal_problems(error, path, data)
        assert not problems, problems
        return None
    note("accepted")
    problems = exercise(config)
    assert not problems, problems
    return config


# -- field by field: every node of a valid config replaced by every other type --------------


def emit(document: Any) -> bytes:
    """What :func:`dump` writes, by libyaml's emitter when PyYAML has it (a fifth of the CPU
    of the pure-Python one, which took a quarter of the loop below)."""
    if not yaml.__with_libyaml__:
        return dump(document)
    return yaml.dump(document, Dumper=yaml.CSafeDumper, sort_keys=False, allow_unicode=True).encode()


@pytest.mark.parametrize("base", list(BASES))
def test_every_field_replaced_by_every_type(fz, base, tmp_path):
    """Also: every field removed, every list item doubled (about 1,000 loads per base, each
    variant once; one directory for all, as a temporary one each cost a tenth of a load)."""
    document = yaml.safe_load(BASES[base])
    assert load(fz, dump(document)) is not None, "the unmutated base must load"
    outcomes = {"accepted": 0, "refused": 0}
    for data in dict.fromkeys(emit(variant) for variant in field_variants(document)):
        outcome = "accepted" if load(fz, data, tmp_path) is not None else "refused"
        outcomes[outcome] += 1
    # Both outcomes must really happen, or the mutations test nothing.
    assert outcomes["accepted"] > 10 and outcomes["refused"] > 100, outcomes


# -- text and bytes -----------------------------------------------------------------------


LINE_EDITS = st.lists(
    st.tuples(st.integers(0, 4), st.integers(0, 200), st.one_of(st.sampled_from(YAML_BITS), st.text(max_size=6))),
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
    edits=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 5000), st.integers(0, 255)), min_size=1, max_size=8),
)
def test_byte_mutations(fz, base, edits):
    """Flipped, inserted, deleted and duplicated bytes: non-UTF-8, control characters, broken syntax."""
    load(fz, mutate(BASES[base].encode(), edits))


@FUZZ
@given(data=st.binary(max_size=2000))
def test_binary_junk(fz, data):
    load(fz, data)


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


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_files(fz, name):
    """Each hostile file is accepted or refused as expected; ``load`` guards against a hang
    (its time limit), and the bounds that keep a load short are counted in the tests below."""
    config = load(fz, HOSTILE[name])
    assert (config is not None) == (name in ACCEPTED_HOSTILE), name


@pytest.mark.parametrize("name", ["billion laughs", "laughs in descriptors", "merge bomb", "recursive alias"])
def test_alias_bombs_are_refused_with_a_line(fz, name):
    """Regression: descriptor laughs hung (the parser walked every alias reference: 16^8
    descriptors) and the merge bomb ran out of memory (PyYAML's merge flattening doubles per
    level before any node is counted); now every alias counts its expanded size."""
    with tempfile.TemporaryDirectory() as directory:
        (Path(directory) / "bomb.yaml").write_bytes(HOSTILE[name])
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
    the same path is checked in milliseconds. Counted, not timed: composing stops at the
    cap's next node, and nothing is constructed."""
    monkeypatch.setattr(yaml_source, "MAX_NODES", 2_000)
    loader = yaml_source._MarkedLoader
    calls = {"composed": 0, "constructed": 0}
    compose, construct = loader.compose_node, loader.construct_object

    def counting_compose(self: Any, parent: Any, index: int) -> Any:
        calls["composed"] += 1
        return compose(self, parent, index)

    def counting_construct(self: Any, node: Any, deep: bool = False) -> Any:
        calls["constructed"] += 1
        return construct(self, node, deep=deep)

    monkeypatch.setattr(loader, "compose_node", counting_compose)
    monkeypatch.setattr(loader, "construct_object", counting_construct)
    assert load(fz, flat_node_flood(1_000_000).encode()) is None
    assert calls == {"composed": yaml_source.MAX_NODES + 1, "constructed": 0}
