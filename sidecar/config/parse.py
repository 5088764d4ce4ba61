"""Turn one parsed YAML document into a validated :class:`DomainConfig`.

Every problem is collected (not just the first) so a user fixes a file in one pass.
Field names follow envoyproxy/ratelimit; unknown keys are errors because a typo
such as ``ratelimit`` or ``requestsperunit`` would otherwise silently drop a limit.
"""

from __future__ import annotations

from typing import Any

from sidecar.config.errors import ConfigIssue
from sidecar.config.model import (
    DescriptorNode,
    DomainConfig,
    Level,
    RateLimitRule,
    counter_id,
    stat_key,
    wildcard_matcher,
)
from sidecar.config.yaml_source import MarkedMapping
from sidecar.limiter.windows import UNIT_NAMES, Unit

ROOT_FIELDS = frozenset({"domain", "descriptors", "metadata"})
DESCRIPTOR_FIELDS = frozenset(
    {
        "key",
        "value",
        "rate_limit",
        "descriptors",
        "shadow_mode",
        "detailed_metric",
        "share_threshold",
        "quota_mode",
        "metadata",
    }
)
RATE_LIMIT_FIELDS = frozenset({"requests_per_unit", "unit", "unlimited", "name", "replaces", "warn_at"})
FLAG_FIELDS = ("shadow_mode", "detailed_metric", "share_threshold", "quota_mode")
MAX_REQUESTS_PER_UNIT = 2**32 - 1
"""The proto carries ``requests_per_unit`` as uint32."""
MAX_DEPTH = 16
"""Deeper trees are certainly mistakes; Envoy descriptors rarely exceed 3-4 entries."""

PathStep = tuple[str, str | None]


class DomainParser:
    """Validates one file's document; collects issues instead of stopping at the first."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.issues: list[ConfigIssue] = []
        self.rules: list[RateLimitRule] = []
        self.domain = ""
        self._replace_refs: list[tuple[str, int, str]] = []
        """Every ``replaces`` name with its line and path, checked once all rules are known."""

    def parse(self, document: Any) -> DomainConfig | None:
        """Return the domain, or None when any issue was found."""
        if not isinstance(document, MarkedMapping):
            kind = "an empty file" if document is None else type(document).__name__
            self._issue(1, "", f"expected a mapping with 'domain' and 'descriptors', got {kind}")
            return None
        self._unknown_fields(document, ROOT_FIELDS, "")
        domain = document.get("domain")
        if not isinstance(domain, str) or not domain.strip():
            self._issue(document.line_of("domain"), "domain", "must be a non-empty string")
        else:
            self.domain = domain
        root = Level()
        self._parse_level(document, "descriptors", "", [], root)
        self._check_replaces(document.line)
        if self.issues:
            return None
        warns = any(rule.warn_at is not None for rule in self.rules)
        return DomainConfig(self.domain, root, self.file, tuple(self.rules), document.line_of("domain"), warns)

    def _parse_level(
        self,
        parent: MarkedMapping,
        field: str,
        path: str,
        config_path: list[PathStep],
        level: Level,
    ) -> None:
        where = f"{path}.{field}" if path else field
        items = parent.get(field)
        if items is None:
            return
        if not isinstance(items, list):
            self._issue(parent.line_of(field), where, "must be a list of descriptors")
            return
        if len(config_path) >= MAX_DEPTH:
            self._issue(parent.line_of(field), where, f"descriptors nested deeper than {MAX_DEPTH}")
            return
        seen: dict[PathStep, int] = {}
        for index, item in enumerate(items):
            item_path = f"{where}[{index}]"
            if not isinstance(item, MarkedMapping):
                self._issue(parent.line_of(field), item_path, "must be a mapping with a 'key'")
                continue
            node = self._parse_descriptor(item, item_path, config_path, seen)
            if node is not None:
                level.add(node)

    def _parse_descriptor(
        self,
        item: MarkedMapping,
        path: str,
        config_path: list[PathStep],
        seen: dict[PathStep, int],
    ) -> DescriptorNode | None:
        self._unknown_fields(item, DESCRIPTOR_FIELDS, path)
        key = item.get("key")
        if not isinstance(key, str) or not key:
            self._issue(item.line_of("key"), f"{path}.key", "must be a non-empty string")
            key = None
        value = self._value(item, path)
        flags = {name: self._flag(item, name, path) for name in FLAG_FIELDS}
        wildcard = wildcard_matcher(value) if value is not None and "*" in value else None
        if flags["share_threshold"] and wildcard is None:
            self._issue(
                item.line_of("share_threshold"),
                f"{path}.share_threshold",
                "needs a wildcard value (one containing '*') to share a counter across",
            )
        step: PathStep = (key or "", value)
        if key is not None and step in seen:
            shown = key if value is None else f"{key}={value}"
            self._issue(item.line, path, f"duplicate descriptor {shown!r} (first on line {seen[step]})")
        seen[step] = item.line
        node_path = [*config_path, step]
        rule = self._parse_rate_limit(item, path, node_path, flags)
        children = Level()
        self._parse_level(item, "descriptors", path, node_path, children)
        if key is None:
            return None
        return DescriptorNode(key, value, rule, children, wildcard, flags["share_threshold"])

    def _value(self, item: MarkedMapping, path: str) -> str | None:
        if "value" not in item:
            return None
        value = item["value"]
        if isinstance(value, bool) or not isinstance(value, str | int):
            self._issue(item.line_of("value"), f"{path}.value", "must be a string")
            return None
        # A number is kept as written: YAML 1.1 reads 010 as 8 and 12:30 as 750.
        text = value if isinstance(value, str) else item.scalar_texts.get("value", str(value))
        if not text:
            return None
        return text

    def _flag(self, item: MarkedMapping, name: str, path: str) -> bool:
        value = item.get(name, False)
        if not isinstance(value, bool):
            self._issue(item.line_of(name), f"{path}.{name}", "must be true or false")
            return False
        return value

    def _parse_rate_limit(
        self,
        item: MarkedMapping,
        path: str,
        node_path: list[PathStep],
        flags: dict[str, bool],
    ) -> RateLimitRule | None:
        if "rate_limit" not in item:
            return None
        block = item["rate_limit"]
        where = f"{path}.rate_limit"
        if not isinstance(block, MarkedMapping):
            self._issue(item.line_of("rate_limit"), where, "must be a mapping")
            return None
        self._unknown_fields(block, RATE_LIMIT_FIELDS, where)
        unlimited = self._flag(block, "unlimited", where)
        unit = self._unit(block, where, unlimited)
        requests = self._requests_per_unit(block, where, unlimited)
        name = self._name(block, where)
        replaces = self._replaces(block, where, name)
        warn_at = self._warn_at(block, where, unlimited)
        rule = RateLimitRule(
            domain=self.domain,
            requests_per_unit=requests,
            unit=unit,
            unlimited=unlimited,
            name=name,
            replaces=replaces,
            shadow_mode=flags["shadow_mode"],
            quota_mode=flags["quota_mode"],
            detailed_metric=flags["detailed_metric"],
            stat_key=stat_key(self.domain, node_path),
            counter_id=counter_id(self.domain, unit, node_path),
            source=f"{self.file}:{block.line}",
            warn_at=warn_at,
        )
        self.rules.append(rule)
        return rule

    def _unit(self, block: MarkedMapping, where: str, unlimited: bool) -> Unit | None:
        if "unit" not in block:
            if not unlimited:
                self._issue(block.line, f"{where}.unit", f"is required (one of {UNIT_NAMES})")
            return None
        if unlimited:
            self._issue(block.line_of("unit"), f"{where}.unit", "must not be set when unlimited")
            return None
        text = block["unit"]
        try:
            if not isinstance(text, str):
                raise KeyError(text)
            return Unit.parse(text)
        except KeyError:
            self._issue(
                block.line_of("unit"),
                f"{where}.unit",
                f"invalid unit {text!r} (one of {UNIT_NAMES})",
            )
            return None

    def _requests_per_unit(self, block: MarkedMapping, where: str, unlimited: bool) -> int:
        field = f"{where}.requests_per_unit"
        if "requests_per_unit" not in block:
            if not unlimited:
                self._issue(block.line, field, "is required")
            return 0
        value = block["requests_per_unit"]
        line = block.line_of("requests_per_unit")
        if unlimited:
            self._issue(line, field, "must not be set when unlimited")
            return 0
        if isinstance(value, bool) or not isinstance(value, int):
            self._issue(line, field, f"must be a whole number, got {value!r}")
            return 0
        if not 0 <= value <= MAX_REQUESTS_PER_UNIT:
            self._issue(line, field, f"must be between 0 and {MAX_REQUESTS_PER_UNIT}, got {value}")
            return 0
        return value

    def _warn_at(self, block: MarkedMapping, where: str, unlimited: bool) -> float | None:
        """``warn_at`` (our extension): a soft limit, as a fraction of the limit strictly between 0 and 1."""
        if "warn_at" not in block:
            return None
        value = block["warn_at"]
        field, line = f"{where}.warn_at", block.line_of("warn_at")
        if unlimited:
            self._issue(line, field, "must not be set when unlimited (there is no limit to warn before)")
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1:
            # YAML 1.1 reads 85% and 5e-7 (no dot) as text: say so rather than show a quoted number.
            hint = " (text, not a number: write a decimal such as 0.85)" if isinstance(value, str) else ""
            message = f"must be a fraction of the limit between 0 and 1 (exclusive), got {value!r}{hint}"
            self._issue(line, field, message)
            return None
        return float(value)

    def _name(self, block: MarkedMapping, where: str) -> str | None:
        if "name" not in block:
            return None
        name = block["name"]
        if not isinstance(name, str) or not name:
            self._issue(block.line_of("name"), f"{where}.name", "must be a non-empty string")
            return None
        return name

    def _replaces(self, block: MarkedMapping, where: str, own_name: str | None) -> frozenset[str]:
        entries = block.get("replaces")
        if entries is None:
            return frozenset()
        line = block.line_of("replaces")
        if not isinstance(entries, list):
            self._issue(line, f"{where}.replaces", "must be a list of {name: ...} entries")
            return frozenset()
        names: set[str] = set()
        for index, entry in enumerate(entries):
            field = f"{where}.replaces[{index}]"
            if not isinstance(entry, MarkedMapping):
                self._issue(line, field, "must be a mapping with a 'name'")
                continue
            self._unknown_fields(entry, frozenset({"name"}), field)
            name = entry.get("name")
            if not isinstance(name, str) or not name:
                self._issue(entry.line_of("name"), f"{field}.name", "must be a non-empty string")
            elif name == own_name:
                self._issue(entry.line_of("name"), f"{field}.name", "a rule cannot replace itself")
            else:
                names.add(name)
                self._replace_refs.append((name, entry.line_of("name"), f"{field}.name"))
        return frozenset(names)

    def _check_replaces(self, line: int) -> None:
        """A ``replaces`` naming no rule of the domain is a typo that would do nothing."""
        names = {rule.name for rule in self.rules if rule.name}
        for name, ref_line, field in self._replace_refs:
            if name not in names:
                self._issue(ref_line or line, field, f"no rate_limit in this domain is named {name!r}")

    def _unknown_fields(self, mapping: MarkedMapping, allowed: frozenset[str], path: str) -> None:
        for key in mapping:
            if key not in allowed:
                where = f"{path}.{key}" if path else str(key)
                expected = ", ".join(sorted(allowed))
                self._issue(mapping.line_of(key), where, f"unknown field (expected one of {expected})")

    def _issue(self, line: int, path: str, message: str) -> None:
        self.issues.append(ConfigIssue(self.file, line, path, message))
