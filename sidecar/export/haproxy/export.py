"""``export-haproxy``: :func:`export` (plan, then render) and its command line."""

from __future__ import annotations

import argparse
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from sidecar.config.load import load_config
from sidecar.config.model import DomainConfig
from sidecar.export.haproxy.flags import sources_from_flags
from sidecar.export.haproxy.model import DEFAULT_TABLE_SIZE, FLAVOURS, Sources
from sidecar.export.haproxy.plan import ExportOptions, Planner
from sidecar.export.haproxy.render import Renderer
from sidecar.export.haproxy.routes import sources_from_envoy
from sidecar.export.haproxy.words import CONTROL
from sidecar.export.problems import ExportError, Problem, Refusal, refusal
from sidecar.export.rules import pick_domain, where_of


@dataclass(frozen=True, slots=True)
class Export:
    """The result: the config fragment and every problem found on the way."""

    text: str
    problems: tuple[Problem, ...]
    failed: bool = False
    """True when a limit would be left out and ``--allow-dropped`` was not given (``text`` empty)."""

    @property
    def dropped(self) -> tuple[Problem, ...]:
        """The limits or descriptors left out (notes are differences, not losses)."""
        return tuple(problem for problem in self.problems if not problem.exported)


def export(domain: DomainConfig, sources: Sources, options: ExportOptions) -> Export:
    """The HAProxy fragment enforcing ``domain``'s rules for the requests ``sources`` describes."""
    plan = Planner(domain, sources, options)
    text = Renderer(plan).render()
    return Export(text, sorted_problems(domain, plan.problems))


def sorted_problems(domain: DomainConfig, problems: Sequence[Problem]) -> tuple[Problem, ...]:
    """Problems without repeats: those about the proxy config first, then per rule in config order."""
    position = {where_of(rule): index for index, rule in enumerate(domain.rules)}
    unique = list(dict.fromkeys(problems))
    return tuple(sorted(unique, key=lambda problem: position.get(problem.where, -1)))


# ---------------------------------------------------------------- command line


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``export-haproxy``."""
    parser.add_argument("config", help="descriptor config: a YAML file or a directory of them")
    parser.add_argument("--flavour", default="fixed", help="fixed (clock-aligned windows, default) or sliding")
    parser.add_argument("--envoy", help="Envoy config whose route rate_limits say which descriptors requests carry")
    parser.add_argument("--domain", help="domain to export (default: the Envoy filter's, or the only one)")
    parser.add_argument(
        "--fetch",
        action="append",
        default=[],
        metavar="KEY=SAMPLE",
        help="HAProxy sample giving a descriptor key's value (default remote_address=src); overrides --envoy",
    )
    parser.add_argument(
        "--when",
        action="append",
        nargs=2,
        default=[],
        metavar=("KEY=VALUE", "ACL"),
        help="without --envoy: the ACL body under which requests carry the constant entry KEY=VALUE",
    )
    parser.add_argument("--table-size", default=DEFAULT_TABLE_SIZE, help="entries per stick table (k, m, g suffixes)")
    parser.add_argument("--peers", help="peers section to name in every stick-table line")
    parser.add_argument(
        "--allow-dropped", action="store_true", help="export even when a limit cannot be translated (listed on stderr)"
    )


def parse_pairs(items: Sequence[str], flag: str) -> dict[str, str]:
    """``KEY=VALUE`` arguments as a mapping."""
    pairs = {}
    for item in items:
        key, sign, value = item.partition("=")
        if not sign or not key or not value:
            raise ExportError(f"{flag} {item!r}: expected KEY=VALUE")
        if CONTROL.search(item):
            raise ExportError(f"{flag} {item!r}: control characters cannot go into a config line")
        pairs[key] = value
    return pairs


def export_options(arguments: argparse.Namespace, command: str) -> ExportOptions:
    """Checked options; :class:`ExportError` names the bad one."""
    if arguments.flavour not in FLAVOURS:
        raise ExportError(f"unknown flavour {arguments.flavour!r} (choose from {', '.join(FLAVOURS)})")
    if not re.fullmatch(r"[1-9][0-9]*[kmg]?", arguments.table_size):
        raise ExportError(f"--table-size {arguments.table_size!r}: expected a number with an optional k, m or g")
    if arguments.peers is not None and not re.fullmatch(r"[A-Za-z0-9_.-]+", arguments.peers):
        raise ExportError(f"--peers {arguments.peers!r}: not a peers section name")
    return ExportOptions(arguments.flavour, arguments.table_size, arguments.peers, command)


def command_line(arguments: argparse.Namespace) -> str:
    """The command that reproduces the export, for the fragment's first comment."""
    words = ["ratelimit-sidecar", "export-haproxy", arguments.config]
    if arguments.envoy:
        words += ["--envoy", arguments.envoy]
    if arguments.domain:
        words += ["--domain", arguments.domain]
    words += ["--flavour", arguments.flavour]
    for item in arguments.fetch:
        words += ["--fetch", item]
    for pair, acl in arguments.when:
        words += ["--when", pair, acl]
    if arguments.table_size != DEFAULT_TABLE_SIZE:
        words += ["--table-size", arguments.table_size]
    if arguments.peers:
        words += ["--peers", arguments.peers]
    if arguments.allow_dropped:
        words.append("--allow-dropped")
    return shlex.join(words)


def run_export(arguments: argparse.Namespace) -> Export:
    """``export-haproxy``: load, read the Envoy config or the flags, export.

    Raises :class:`ConfigError` for a bad descriptor config and :class:`ExportError` for the rest.
    """
    options = export_options(arguments, command_line(arguments))
    fetches = parse_pairs(arguments.fetch, "--fetch")
    whens = {}
    for pair, acl in arguments.when:
        key, value = next(iter(parse_pairs([pair], "--when").items()))
        if not acl.strip() or CONTROL.search(acl):
            raise ExportError(f"--when {pair} {acl!r}: expected an ACL body such as 'path_beg /api'")
        whens[(key, value)] = acl
    config = load_config(arguments.config)
    if arguments.envoy:
        if whens:
            raise ExportError("--when describes requests without Envoy; it cannot be combined with --envoy")
        sources = sources_from_envoy(Path(arguments.envoy), fetches)
        if arguments.domain and arguments.domain != sources.domain:
            raise ExportError(f"--domain {arguments.domain!r}, but {arguments.envoy} uses domain {sources.domain!r}")
        domain = pick_domain(config.domains, sources.domain)
    else:
        domain = pick_domain(config.domains, arguments.domain)
        sources = sources_from_flags(domain, fetches, whens)
    result = export(domain, sources, options)
    if result.dropped and not arguments.allow_dropped:
        last = Refusal("export-haproxy", refusal("export-haproxy", len(result.dropped)), True)
        return Export("", (*result.problems, last), True)
    return result
