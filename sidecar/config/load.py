"""Load a config file or a directory of them into one :class:`RateLimitConfig`.

A directory is read the way a Kubernetes ConfigMap mount presents it: every
``*.yaml``/``*.yml`` file (symlinks followed), skipping dot-files and
dot-directories such as ``..data`` and ``..2024_01_01_00_00_00.123`` that hold the
real files behind the symlinks, so nothing is loaded twice.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path

from sidecar.config.errors import ConfigError, ConfigIssue
from sidecar.config.model import DomainConfig, RateLimitConfig
from sidecar.config.parse import DomainParser
from sidecar.config.yaml_source import MAX_FILE_BYTES, YamlError, load_yaml, too_large
from sidecar.limiter.algorithms import Algorithm

YAML_SUFFIXES = (".yaml", ".yml")


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


def parse_text(text: str, file: str, max_bytes: int = MAX_FILE_BYTES) -> tuple[DomainConfig | None, list[ConfigIssue]]:
    """Parse one file's text; returns the domain or the issues found."""
    try:
        document = load_yaml(text, max_bytes)
    except YamlError as problem:
        return None, [ConfigIssue(file, problem.line, "", str(problem))]
    parser = DomainParser(file)
    return parser.parse(document), parser.issues


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


def load_config(path: str | Path, mode: str | None = None, max_bytes: int = MAX_FILE_BYTES) -> RateLimitConfig:
    """Load and validate everything under ``path``; :class:`ConfigError` lists all issues.

    ``mode``: the Redis mode that will enforce it (``sync`` refuses token buckets).
    ``max_bytes`` (``--max-config-bytes``): a larger file is refused before it is read.
    """
    files = config_files(Path(path))
    issues: list[ConfigIssue] = []
    domains: dict[str, DomainConfig] = {}
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
        domain, found = parse_text(text, name, max_bytes)
        issues.extend(found)
        if domain is None:
            continue
        if domain.name in domains:
            first = domains[domain.name]
            issues.append(
                ConfigIssue(
                    name,
                    domain.line,
                    "domain",
                    f"duplicate domain {domain.name!r} (also in {first.source}:{first.line})",
                )
            )
            continue
        domains[domain.name] = domain
    issues += mode_issues(domains, mode)
    if issues:
        raise ConfigError(issues)
    return RateLimitConfig(domains, tuple(str(file) for file in files), digest.hexdigest())
