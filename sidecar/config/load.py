"""Load a config file or a directory of them into one :class:`RateLimitConfig`.

A directory is read the way a Kubernetes ConfigMap mount presents it: every
``*.yaml``/``*.yml`` file (symlinks followed), skipping dot-files and
dot-directories such as ``..data`` and ``..2024_01_01_00_00_00.123`` that hold the
real files behind the symlinks, so nothing is loaded twice.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from sidecar.config.errors import ConfigError, ConfigIssue
from sidecar.config.model import DescriptorNode, DomainConfig, Level, RateLimitConfig
from sidecar.config.parse import DomainParser, unknown_replace
from sidecar.config.yaml_source import MAX_FILE_BYTES, YamlError, load_yaml, too_large
from sidecar.limiter.algorithms import Algorithm

YAML_SUFFIXES = (".yaml", ".yml")


@dataclass(frozen=True)
class LoadOptions:
    """How files are read, beyond their text: settings of the process, not of a file."""

    merge_domains: bool = False
    """``--merge-domain-config`` (``MERGE_DOMAIN_CONFIG``): files naming one domain are
    merged, their top-level descriptors side by side; one in two files is an error."""
    calendar_months: bool = False
    """``--calendar-months`` (``USE_CALENDAR_MONTH_RATE_LIMIT``): ``unit: month`` is the
    UTC calendar month instead of 30 days."""


DEFAULT_OPTIONS = LoadOptions()
MERGE_HINT = "set --merge-domain-config (MERGE_DOMAIN_CONFIG=true) to merge the files of one domain"


def config_files(path: Path) -> list[Path]:
    """The YAML files a path stands for, in a stable order; raises on a missing path."""
    if not path.exists():
        raise ConfigError([ConfigIssue(str(path), 0, "", "no such file or directory")])
    if path.is_file():
        return [path]
    files = sorted(
        candidate
        for candidate in path.rglob("*")
        if candidate.suffix in YAML_SUFFIXES
        and candidate.is_file()
        and not any(part.startswith(".") for part in candidate.relative_to(path).parts)
    )
    if not files:
        raise ConfigError([ConfigIssue(str(path), 0, "", "directory holds no *.yaml or *.yml files")])
    return files


def parse_text(
    text: str, file: str, max_bytes: int = MAX_FILE_BYTES, options: LoadOptions = DEFAULT_OPTIONS
) -> tuple[DomainConfig | None, list[ConfigIssue]]:
    """Parse one file's text; returns the domain or the issues found."""
    domain, issues, _ = parse_named(text, file, max_bytes, options)
    return domain, issues


def parse_named(
    text: str, file: str, max_bytes: int = MAX_FILE_BYTES, options: LoadOptions = DEFAULT_OPTIONS
) -> tuple[DomainConfig | None, list[ConfigIssue], tuple[str, int] | None]:
    """:func:`parse_text`, plus the domain's name and line whenever the file names one,
    valid or not: a file refused for another reason still claims its domain, so a
    duplicate of it is reported in the same run (every error at once)."""
    try:
        document = load_yaml(text, max_bytes)
    except YamlError as problem:
        return None, [ConfigIssue(file, problem.line, "", str(problem))], None
    parser = DomainParser(file, calendar_months=options.calendar_months)
    domain = parser.parse(document, check_replaces=not options.merge_domains)
    named = (parser.domain, document.line_of("domain")) if parser.domain else None
    return domain, parser.issues, named


SYNC_MODE = "sync"


def mode_issues(domains: Mapping[str, DomainConfig], mode: str | None) -> list[ConfigIssue]:
    """Rules the backend that will run them cannot enforce within its promises.

    ``sync`` mode decides from local counts reconciled by addition; a token bucket's
    state is a time (GCRA's TAT) that replicas cannot advance independently and add up
    later without losing the bound sync mode proves for windows, so it is refused
    there rather than enforced approximately.
    """
    if mode != SYNC_MODE:
        return []
    return [
        ConfigIssue(
            rule.source_file,
            rule.source_line,
            f"{rule.where}.algorithm",
            "token_bucket is not supported in sync mode (--mode sync): use --mode strict, "
            "the memory backend, or a fixed_window/sliding_window limit",
        )
        for domain in domains.values()
        for rule in domain.rules
        if rule.algorithm is Algorithm.TOKEN_BUCKET
    ]


def read_capped(file: Path, max_bytes: int) -> bytes:
    """The file's bytes; :class:`YamlError` naming its size, before reading, past ``max_bytes``.

    A file that grows while it is read (or claims size 0, as some special files do) is
    read no further than one byte past the cap.
    """
    size = file.stat().st_size
    if size > max_bytes:
        raise YamlError(too_large(size, max_bytes))
    with file.open("rb") as handle:
        raw = handle.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise YamlError(f"file grew over the {max_bytes:,}-byte cap (--max-config-bytes) while being read")
    return raw


def load_config(
    path: str | Path, mode: str | None = None, max_bytes: int = MAX_FILE_BYTES, options: LoadOptions = DEFAULT_OPTIONS
) -> RateLimitConfig:
    """Load and validate everything under ``path``; :class:`ConfigError` lists all issues.

    ``mode``: the Redis mode that will enforce it (``sync`` refuses token buckets).
    ``max_bytes`` (``--max-config-bytes``): a larger file is refused before it is read.
    ``options``: merging domains across files, calendar months (:class:`LoadOptions`).
    """
    files = config_files(Path(path))
    issues: list[ConfigIssue] = []
    domains: dict[str, DomainConfig] = {}
    claimed: dict[str, tuple[str, int]] = {}
    """Domain name -> (file, line) of the first file naming it, refused files included."""
    digest = hashlib.sha256()
    for file in files:
        name = str(file)
        try:
            raw = read_capped(file, max_bytes)
        except OSError as error:
            issues.append(ConfigIssue(name, 0, "", f"cannot read: {error}"))
            continue
        except YamlError as too_large_file:
            issues.append(ConfigIssue(name, 0, "", str(too_large_file)))
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            line = raw.count(b"\n", 0, error.start) + 1
            problem = f"cannot read: not UTF-8 (byte 0x{raw[error.start]:02x}: {error.reason})"
            issues.append(ConfigIssue(name, line, "", problem))
            continue
        digest.update(name.encode() + b"\0" + raw + b"\0")
        domain, found, named = parse_named(text, name, max_bytes, options)
        issues.extend(found)
        if named is not None and not options.merge_domains and named[0] in claimed:
            first_file, first_line = claimed[named[0]]
            problem = f"duplicate domain {named[0]!r} (also in {first_file}:{first_line}): {MERGE_HINT}"
            issues.append(ConfigIssue(name, named[1], "domain", problem))
            continue
        if named is not None:
            claimed.setdefault(named[0], (name, named[1]))
        if domain is None:
            continue
        if domain.name in domains:
            domains[domain.name] = merge_domains(domains[domain.name], domain, issues)
            continue
        domains[domain.name] = domain
    if options.merge_domains:
        issues += [issue for domain in domains.values() for issue in replace_issues(domain)]
    issues += mode_issues(domains, mode)
    if issues:
        raise ConfigError(issues)
    return RateLimitConfig(domains, tuple(str(file) for file in files), digest.hexdigest())


def merge_domains(first: DomainConfig, second: DomainConfig, issues: list[ConfigIssue]) -> DomainConfig:
    """``second``'s top-level descriptors added to ``first``'s, as envoyproxy/ratelimit merges
    (``MERGE_DOMAIN_CONFIG``): a top-level descriptor in both files is an issue naming both."""
    root = Level(dict(first.root.exact), {key: list(nodes) for key, nodes in first.root.wildcards.items()})
    root.defaults = dict(first.root.defaults)
    for node in second.root.nodes():
        clash = same_place(root, node)
        if clash is not None:
            shown = node.key if node.value is None else f"{node.key}={node.value}"
            issues.append(
                ConfigIssue(
                    second.source,
                    node_line(node, second),
                    "descriptors",
                    f"duplicate descriptor {shown!r} in domain {first.name!r}, also in "
                    f"{node_source(clash, first)}: keep it in one file",
                )
            )
            continue
        root.add(node)
    return replace(
        first,
        root=root,
        rules=first.rules + second.rules,
        warns=first.warns or second.warns,
        replace_refs=first.replace_refs + second.replace_refs,
        sources=(*(first.sources or (first.source,)), second.source),
    )


def same_place(level: Level, node: DescriptorNode) -> DescriptorNode | None:
    """The node of ``level`` that ``node`` would take the place of, if any."""
    if node.value is None:
        return level.defaults.get(node.key)
    if node.wildcard is None:
        return level.exact.get((node.key, node.value))
    return next((other for other in level.wildcards.get(node.key, ()) if other.value == node.value), None)


def node_rules(node: DescriptorNode) -> list[str]:
    """Sources (``file:line``) of the rules at or under ``node``, in tree order."""
    found = [rule.source for rule in (node.rule, *node.more) if rule is not None]
    for child in node.children.nodes():
        found += node_rules(child)
    return found


def node_source(node: DescriptorNode, domain: DomainConfig) -> str:
    """Where ``node`` comes from: the first rule at or under it, else the domain's first file."""
    sources = node_rules(node)
    return sources[0] if sources else domain.source


def node_line(node: DescriptorNode, domain: DomainConfig) -> int:
    sources = node_rules(node)
    return int(sources[0].rsplit(":", 1)[1]) if sources else domain.line


def replace_issues(domain: DomainConfig) -> list[ConfigIssue]:
    """``replaces`` naming no rule of the merged domain (checked per file when not merging)."""
    names = {rule.name for rule in domain.rules if rule.name}
    return [
        ConfigIssue(
            file,
            line,
            field,
            unknown_replace(name),
        )
        for name, file, line, field in domain.replace_refs
        if name not in names
    ]
