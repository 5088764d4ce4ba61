"""Reading ``--fetch``/``--when`` instead of Envoy: descriptors taken off the config tree itself."""

from __future__ import annotations

from collections.abc import Mapping

from sidecar.config.model import DescriptorNode, DomainConfig, Level
from sidecar.export.haproxy.model import (
    ADDRESS_LENGTH,
    FLAGS_ROUTE,
    Condition,
    Const,
    Fetch,
    Producer,
    Route,
    Source,
    Sources,
    Test,
)
from sidecar.export.haproxy.words import hint_of
from sidecar.export.problems import Problem
from sidecar.export.rules import subtree_rules, where_of


def sources_from_flags(
    domain: DomainConfig, fetches: Mapping[str, str], whens: Mapping[tuple[str, str], str]
) -> Sources:
    """Descriptors read off the config tree itself: a key's value from ``--fetch``, a constant's presence
    from ``--when``; every path down to a rule is assumed sent on every request whose tests hold."""
    fetch_of = {"remote_address": "src", **fetches}
    shapes: dict[tuple[tuple[str, Source], ...], Condition] = {}
    order = {id(rule): index for index, rule in enumerate(domain.rules)}
    first: dict[tuple[tuple[str, Source], ...], int] = {}
    """The config position of the first rule each shape reaches: producers keep the config's order."""
    problems: list[Problem] = []

    def visit(level: Level, path: tuple[tuple[str, Source], ...], condition: Condition) -> None:
        for node in level.nodes():
            step = flag_step(node, fetch_of, whens)
            if isinstance(step, str):
                problems.extend(Problem(where_of(rule), step) for rule in subtree_rules(node))
                continue
            (key, source), tests = step
            here, held = (*path, (key, source)), (*condition, *tests)
            if node.rule is not None:
                shapes.setdefault(here, held)
                first[here] = min(first.get(here, len(order)), order[id(node.rule)])
            visit(node.children, here, held)

    visit(domain.root, (), ())
    producers = tuple(
        Producer("flags", entries, condition)
        for entries, condition in sorted(shapes.items(), key=lambda item: first[item[0]])
    )
    return Sources(domain.name, "--fetch/--when flags", (Route(FLAGS_ROUTE, None, producers),), tuple(problems))


def flag_step(
    node: DescriptorNode, fetch_of: Mapping[str, str], whens: Mapping[tuple[str, str], str]
) -> tuple[tuple[str, Source], Condition] | str:
    """A tree node's entry as the flags describe it, or why it cannot be produced."""
    sample = fetch_of.get(node.key)
    if sample is not None:
        source = Fetch(sample, always=sample == "src", max_length=ADDRESS_LENGTH if sample == "src" else None)
        presence = () if source.always else (Test(f"{sample} -m found", f"has_{hint_of(node.key)}"),)
        return (node.key, source), presence
    if node.value is not None and node.wildcard is None:
        acl = whens.get((node.key, node.value))
        if acl is not None:
            return (node.key, Const(node.value)), (Test(acl, f"when_{hint_of(node.value)}"),)
        return f"no --when {node.key}={node.value} says when HAProxy sends it (or --fetch {node.key}=SAMPLE)"
    return f"no --fetch {node.key}=SAMPLE says where HAProxy reads the {node.key!r} value"
