"""Which requests Envoy routes to a virtual host, so that an exporter tests the host as Envoy does.

Envoy picks a request's virtual host from its ``:authority`` (lower-cased; with the route
config's ``ignore_port_in_host_matching``, without its port) before it picks a route: an
exact domain first, then the longest matching suffix wildcard (``*.example.com``), then the
longest matching prefix wildcard (``api.*``), then the host for every domain (``*``). A
wildcard stands for one character or more. When ``*`` is the only domain of the only host,
every request gets it, ``:authority`` or not; otherwise a request without one gets no host.

A limit of one host must never be applied to a request another host takes, so each exporter
tests, per host, "one of its domains matches and no domain that outranks it does"
(:class:`HostTest`): :func:`host_tests` lists, per domain, the other hosts' domains that win
over it for some request. Exporters write those as their own predicates or ACLs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from sidecar.export.problems import ExportError

Kind = Literal["exact", "suffix", "prefix", "any"]


@dataclass(frozen=True, slots=True)
class Domain:
    """One entry of a host's ``domains``: ``exact`` (the name), ``suffix`` (what follows ``*``),
    ``prefix`` (what precedes ``*``) or ``any`` (``*``); ``text`` is lower-cased, as Envoy keeps it."""

    kind: Kind
    text: str

    def __str__(self) -> str:
        return {"exact": self.text, "suffix": "*" + self.text, "prefix": self.text + "*", "any": "*"}[self.kind]

    def matches(self, host: str) -> bool:
        """Whether Envoy would match ``host`` (lower-cased, port handled) with this domain."""
        if self.kind == "exact":
            return host == self.text
        if self.kind == "suffix":
            return len(host) > len(self.text) and host.endswith(self.text)
        if self.kind == "prefix":
            return len(host) > len(self.text) and host.startswith(self.text)
        return True


def parse_domain(text: str, where: str) -> Domain:
    """A ``domains`` entry; :class:`ExportError` for one Envoy itself refuses (a ``*`` inside)."""
    lowered = text.lower()
    if lowered == "*":
        return Domain("any", "")
    if lowered.startswith("*") and "*" not in lowered[1:]:
        return Domain("suffix", lowered[1:])
    if lowered.endswith("*") and "*" not in lowered[:-1]:
        return Domain("prefix", lowered[:-1])
    if "*" in lowered or not lowered:
        raise ExportError(f"{where}: domain {text!r}: Envoy allows '*' only alone, first or last")
    return Domain("exact", lowered)


def outranks(rival: Domain, mine: Domain) -> bool:
    """Whether ``rival`` (another host's domain) wins over ``mine`` for some request both match."""
    if mine.kind == "exact" or rival.kind == "any":
        return False
    if rival.kind == "exact":
        return mine.matches(rival.text)
    if mine.kind == "any":
        return True
    if rival.kind == "suffix":
        if mine.kind == "prefix":
            return True  # a suffix wildcard beats every prefix one, and some host matches both
        return len(rival.text) > len(mine.text) and rival.text.endswith(mine.text)
    return mine.kind == "prefix" and len(rival.text) > len(mine.text) and rival.text.startswith(mine.text)


@dataclass(frozen=True, slots=True)
class HostTest:
    """The requests Envoy gives one virtual host: ``choices`` pairs each of its domains with the
    other hosts' domains that win over it; ``everything`` when it is the only host and serves
    ``*`` (no test at all); ``ignore_port``: ``:authority`` is compared without its port."""

    name: str
    choices: tuple[tuple[Domain, tuple[Domain, ...]], ...]
    everything: bool
    ignore_port: bool


def host_tests(route_config: Mapping[str, Any], origin: str) -> list[HostTest]:
    """One :class:`HostTest` per virtual host of ``route_config``, in its order."""
    hosts: Sequence[Mapping[str, Any]] = route_config.get("virtual_hosts") or []
    ignore_port = bool(route_config.get("ignore_port_in_host_matching"))
    parsed = [
        [
            parse_domain(str(text), f"{origin}: virtual host {host.get('name', '?')!r}")
            for text in host.get("domains") or []
        ]
        for host in hosts
    ]
    seen: dict[Domain, str] = {}
    for host, domains in zip(hosts, parsed, strict=True):
        if not domains:
            raise ExportError(
                f"{origin}: virtual host {host.get('name', '?')!r} has no domains: Envoy refuses the config"
            )
        for domain in domains:
            if domain in seen:
                raise ExportError(
                    f"{origin}: domain {str(domain)!r} is in virtual hosts {seen[domain]!r} and "
                    f"{host.get('name', '?')!r}: Envoy refuses the config"
                )
            seen[domain] = str(host.get("name", "?"))
    tests = []
    for number, (host, domains) in enumerate(zip(hosts, parsed, strict=True)):
        rivals = [domain for other, found in enumerate(parsed) if other != number for domain in found]
        choices = tuple((mine, tuple(rival for rival in rivals if outranks(rival, mine))) for mine in domains)
        everything = len(hosts) == 1 and any(domain.kind == "any" for domain in domains)
        tests.append(HostTest(str(host.get("name", number)), choices, everything, ignore_port))
    return tests
