"""Turn one parsed YAML document into a validated :class:`DomainConfig`.

Every problem is collected (not just the first) so a user fixes a file in one pass.
Field names follow envoyproxy/ratelimit; unknown keys are errors because a typo
such as ``ratelimit`` or ``requestsperunit`` would otherwise silently drop a limit.
"""

from __future__ import annotations

import re
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
from sidecar.limiter.algorithms import ALGORITHM_NAMES, Algorithm, emission_interval_us
from sidecar.limiter.windows import CALENDAR_MONTH, UNIT_NAMES, Unit

ROOT_FIELDS = frozenset({"domain", "descriptors", "metadata"})
DESCRIPTOR_FIELDS = frozenset(
    {
        "key",
        "value",
        "rate_limit",
        "rate_limits",
        "descriptors",
        "shadow_mode",
        "detailed_metric",
        "share_threshold",
        "quota_mode",
        "metadata",
        "value_to_metric",
    }
)
RATE_LIMIT_FIELDS = frozenset(
    {
        "requests_per_unit",
        "unit",
        "unlimited",
        "name",
        "replaces",
        "warn_at",
        "algorithm",
        "unit_multiplier",
        "burst",
        "ban_duration",
        "count_past_limit",
        "overload",
    }
)
FLAG_FIELDS = ("shadow_mode", "detailed_metric", "share_threshold", "quota_mode", "value_to_metric")
MAX_REQUESTS_PER_UNIT = 2**32 - 1
"""The proto carries ``requests_per_unit`` as uint32."""
MAX_WINDOW_SECONDS = 100 * 365 * 86_400
"""``unit`` times ``unit_multiplier`` beyond a century is certainly a mistake."""
MAX_BAN_SECONDS = 365 * 86_400
DURATION_UNITS = {"s": 1, "m": 60, "h": 3_600, "d": 86_400}
DURATION = re.compile(r"(?:(\d+)([smhd]))+")
DURATION_PART = re.compile(r"(\d+)([smhd])")
OVERLOAD_CHOICES = ("refuse", "suppress")
"""``overload``: refuse once the window is full (the default), or suppress a steady fraction."""
MAX_DEPTH = 16
"""Deeper trees are certainly mistakes; Envoy descriptors rarely exceed 3-4 entries."""

PathStep = tuple[str, str | None]


class DomainParser:
    """Validates one file's document; collects issues instead of stopping at the first."""

    def __init__(self, file: str, *, calendar_months: bool = False) -> None:
        self.file = file
        self.calendar_months = calendar_months
        """``--calendar-months``: a ``month`` window is the UTC calendar month."""
        self.issues: list[ConfigIssue] = []
        self.rules: list[RateLimitRule] = []
        self.domain = ""
        self._replace_refs: list[tuple[str, int, str]] = []
        """Every ``replaces`` name with its line and path, checked once all rules are known."""

    def parse(self, document: Any, *, check_replaces: bool = True) -> DomainConfig | None:
        """Return the domain, or None when any issue was found.

        ``check_replaces=False`` leaves the ``replaces`` names to be checked against the
        whole domain once its files are merged (they are in :attr:`DomainConfig.replace_refs`).
        """
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
        if check_replaces:
            self._check_replaces(document.line)
        if self.issues:
            return None
        warns = any(rule.warn_at is not None for rule in self.rules)
        refs = tuple((name, self.file, line, field) for name, line, field in self._replace_refs)
        return DomainConfig(
            self.domain, root, self.file, tuple(self.rules), document.line_of("domain"), warns, refs, (self.file,)
        )

    def _parse_level(
        self,
        parent: MarkedMapping,
        field: str,
        path: str,
        config_path: list[PathStep],
        level: Level,
        *,
        values_in_stats: bool = False,
    ) -> None:
        where = f"{path}.{field}" if path else field
        items = parent.get(field)
        if items is None:
            return
        if not isinstance(items, list):
            self._issue(parent.line_of(field), where, "must be a list of descriptors")
            return
        if len(config_path) >= MAX_DEPTH:
            self._issue(
                parent.line_of(field),
                where,
                f"descriptors nested deeper than {MAX_DEPTH} (a limit of ours, not of envoyproxy/ratelimit: "
                "Envoy sends a few entries per descriptor, so flatten the tree)",
            )
            return
        seen: dict[PathStep, int] = {}
        for index, item in enumerate(items):
            item_path = f"{where}[{index}]"
            if not isinstance(item, MarkedMapping):
                self._issue(parent.line_of(field), item_path, "must be a mapping with a 'key'")
                continue
            node = self._parse_descriptor(item, item_path, config_path, seen, values_in_stats)
            if node is not None:
                level.add(node)

    def _parse_descriptor(
        self,
        item: MarkedMapping,
        path: str,
        config_path: list[PathStep],
        seen: dict[PathStep, int],
        values_in_stats: bool,
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
        values_in_stats = values_in_stats or flags["value_to_metric"]
        metadata = self._metadata(item, path)
        rules = self._node_limits(item, path, node_path, flags, (metadata, values_in_stats))
        children = Level()
        self._parse_level(item, "descriptors", path, node_path, children, values_in_stats=values_in_stats)
        if key is None:
            return None
        rule = rules[0] if rules else None
        return DescriptorNode(
            key, value, rule, children, wildcard, flags["share_threshold"], tuple(rules[1:]), flags["value_to_metric"]
        )

    def _metadata(self, item: MarkedMapping, path: str) -> dict[str, Any] | None:
        """``metadata``: a mapping of JSON values, carried on the node's rules."""
        if "metadata" not in item:
            return None
        value, line = item["metadata"], item.line_of("metadata")
        problem = json_problem(value, top=True)
        if problem is not None:
            self._issue(line, f"{path}.metadata", f"{problem} (metadata becomes a google.protobuf.Struct)")
            return None
        return plain_json(value)  # type: ignore[no-any-return]

    def _node_limits(
        self,
        item: MarkedMapping,
        path: str,
        node_path: list[PathStep],
        flags: dict[str, bool],
        carried: tuple[dict[str, Any] | None, bool],
    ) -> list[RateLimitRule]:
        """``rate_limit`` and every entry of ``rate_limits`` (an extension), in that order.

        Several limits on one node are enforced together; two with the same window and
        algorithm would only ever let the lower one decide, so they are refused.
        """
        blocks: list[tuple[Any, str, int]] = []
        if "rate_limit" in item:
            blocks.append((item["rate_limit"], f"{path}.rate_limit", item.line_of("rate_limit")))
        if "rate_limits" in item:
            entries = item["rate_limits"]
            if not isinstance(entries, list) or not entries:
                self._issue(
                    item.line_of("rate_limits"), f"{path}.rate_limits", "must be a non-empty list of rate limits"
                )
            else:
                line = item.line_of("rate_limits")
                blocks += [(entry, f"{path}.rate_limits[{index}]", line) for index, entry in enumerate(entries)]
        rules: list[RateLimitRule] = []
        for block, where, line in blocks:
            rule = self._parse_rate_limit(block, where, line, node_path, flags, carried=carried)
            if rule is not None:
                rules.append(rule)
        self._check_limits_together(rules)
        return rules

    def _check_limits_together(self, rules: list[RateLimitRule]) -> None:
        if len(rules) < 2:
            return
        seen: dict[tuple[int, Algorithm], RateLimitRule] = {}
        for rule in rules:
            line = rule.source_line
            if rule.unlimited:
                self._issue(line, rule.where, "unlimited cannot be combined with other limits on the same descriptor")
                continue
            if rule.unit is None:
                continue  # its unit is an issue already; a window of "0 s" would clash with every other
            slot = (rule.unit_seconds, rule.algorithm)
            first = seen.setdefault(slot, rule)
            if first is not rule:
                # Both would also share one counter: the counter id holds the window and algorithm only.
                why = (
                    "both would share one bucket; keep one, or give one another unit (10/second is 600/minute)"
                    if rule.algorithm is Algorithm.TOKEN_BUCKET
                    else "only the lower limit would ever decide; keep one"
                )
                self._issue(
                    line, rule.where, f"same window ({rule.unit_seconds} s) and algorithm as {first.where}: {why}"
                )

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
        block: Any,
        where: str,
        line: int,
        node_path: list[PathStep],
        flags: dict[str, bool],
        *,
        carried: tuple[dict[str, Any] | None, bool],
    ) -> RateLimitRule | None:
        if not isinstance(block, MarkedMapping):
            self._issue(line, where, "must be a mapping")
            return None
        self._unknown_fields(block, RATE_LIMIT_FIELDS, where)
        unlimited = self._flag(block, "unlimited", where)
        unit = self._unit(block, where, unlimited)
        requests = self._requests_per_unit(block, where, unlimited)
        name = self._name(block, where)
        replaces = self._replaces(block, where, name)
        warn_at = self._warn_at(block, where, unlimited)
        named = self._algorithm(block, where, unlimited)
        algorithm = Algorithm.FIXED_WINDOW if named is None else named
        multiplier = self._unit_multiplier(block, where, unit, unlimited)
        burst = self._burst(block, where, named, requests)
        ban_seconds = self._ban_duration(block, where, unlimited)
        suppress = self._overload(block, where, unlimited, named)
        count_past = self._flag(block, "count_past_limit", where)
        if count_past and unlimited:
            self._issue(
                block.line_of("count_past_limit"),
                f"{where}.count_past_limit",
                "must not be set when unlimited (nothing is counted)",
            )
        # Only a rate written as 0: an invalid one has its own issue already.
        written = block.get("requests_per_unit")
        if algorithm is Algorithm.TOKEN_BUCKET and type(written) is int and written == 0:
            self._issue(
                block.line_of("requests_per_unit"),
                f"{where}.requests_per_unit",
                "must be at least 1 for a token_bucket (it is the refill rate)",
            )
        calendar = self._calendar(block, where, unit, multiplier, algorithm)
        seconds = CALENDAR_MONTH if calendar else unit.seconds * multiplier if unit else 0
        interval = (
            emission_interval_us(seconds, requests)
            if algorithm is Algorithm.TOKEN_BUCKET and requests and seconds
            else 0
        )
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
            counter_id=counter_id(self.domain, seconds, node_path, algorithm),
            source=f"{self.file}:{block.line}",
            warn_at=warn_at,
            algorithm=algorithm,
            unit_multiplier=multiplier,
            burst=burst,
            interval_us=interval,
            ban_seconds=ban_seconds,
            where=where,
            count_past=count_past,
            suppress=suppress,
            calendar=calendar,
            metadata=carried[0],
            values_in_stats=carried[1],
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

    def _calendar(
        self, block: MarkedMapping, where: str, unit: Unit | None, multiplier: int, algorithm: Algorithm
    ) -> bool:
        """Whether the window is the UTC calendar month; refuses what such a window cannot be."""
        if unit is not None and unit.seconds * multiplier == CALENDAR_MONTH:
            self._issue(
                block.line_of("unit_multiplier"),
                f"{where}.unit_multiplier",
                f"a window of exactly {CALENDAR_MONTH} s is reserved for calendar months: use another multiplier",
            )
        if not self.calendar_months or unit is not Unit.MONTH:
            return False
        if multiplier != 1:
            self._issue(
                block.line_of("unit_multiplier"),
                f"{where}.unit_multiplier",
                "calendar months (--calendar-months) come one at a time: remove unit_multiplier, or use unit: day",
            )
        if algorithm is not Algorithm.FIXED_WINDOW:
            self._issue(
                block.line_of("algorithm"),
                f"{where}.algorithm",
                "calendar months (--calendar-months) are fixed windows: remove the algorithm, or use unit: day",
            )
        return True

    def _requests_per_unit(self, block: MarkedMapping, where: str, unlimited: bool) -> int:
        field = f"{where}.requests_per_unit"
        if "requests_per_unit" not in block:
            if not unlimited:
                # envoyproxy/ratelimit reads a missing number as 0: every request refused.
                self._issue(
                    block.line,
                    field,
                    "is required (write 0 to refuse every request, as a missing one does in envoyproxy/ratelimit)",
                )
            return 0
        value = block["requests_per_unit"]
        line = block.line_of("requests_per_unit")
        if unlimited:
            self._issue(line, field, "must not be set when unlimited (remove it, or remove unlimited)")
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

    def _algorithm(self, block: MarkedMapping, where: str, unlimited: bool) -> Algorithm | None:
        """The algorithm; None when it is invalid, so a ``burst`` next to a misspelt
        ``token_bucket`` is not reported as well."""
        if "algorithm" not in block:
            return Algorithm.FIXED_WINDOW
        text, line = block["algorithm"], block.line_of("algorithm")
        if unlimited:
            self._issue(line, f"{where}.algorithm", "must not be set when unlimited")
            return Algorithm.FIXED_WINDOW
        if isinstance(text, str) and text.strip().upper() in Algorithm.__members__:
            return Algorithm[text.strip().upper()]
        self._issue(line, f"{where}.algorithm", f"invalid algorithm {text!r} (one of {ALGORITHM_NAMES})")
        return None

    def _unit_multiplier(self, block: MarkedMapping, where: str, unit: Unit | None, unlimited: bool) -> int:
        """``unit_multiplier`` (an extension): windows of N units, still aligned to the epoch."""
        if "unit_multiplier" not in block:
            return 1
        value, line, field = block["unit_multiplier"], block.line_of("unit_multiplier"), f"{where}.unit_multiplier"
        if unlimited:
            self._issue(line, field, "must not be set when unlimited")
            return 1
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            self._issue(line, field, f"must be a whole number of at least 1, got {value!r}")
            return 1
        if unit is not None and unit.seconds * value > MAX_WINDOW_SECONDS:
            self._issue(line, field, f"makes a window of {unit.seconds * value} s, longer than a century")
            return 1
        return value

    def _burst(self, block: MarkedMapping, where: str, algorithm: Algorithm | None, requests: int) -> int:
        """``burst``: a token bucket's size; defaults to ``requests_per_unit``."""
        if "burst" not in block or algorithm is None:
            return requests if algorithm is Algorithm.TOKEN_BUCKET else 0
        value, line, field = block["burst"], block.line_of("burst"), f"{where}.burst"
        if algorithm is not Algorithm.TOKEN_BUCKET:
            self._issue(line, field, "only applies to algorithm: token_bucket")
            return 0
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_REQUESTS_PER_UNIT:
            self._issue(line, field, f"must be a whole number between 1 and {MAX_REQUESTS_PER_UNIT}, got {value!r}")
            return requests
        return value

    def _ban_duration(self, block: MarkedMapping, where: str, unlimited: bool) -> int:
        """``ban_duration``: whole seconds, or a duration such as ``90s``, ``10m``, ``1h30m``, ``1d``."""
        if "ban_duration" not in block:
            return 0
        value, line, field = block["ban_duration"], block.line_of("ban_duration"), f"{where}.ban_duration"
        if unlimited:
            self._issue(line, field, "must not be set when unlimited (nothing can go over)")
            return 0
        seconds = parse_duration(value)
        if seconds is None or not 1 <= seconds <= MAX_BAN_SECONDS:
            self._issue(
                line,
                field,
                f"must be a duration from 1 s to 365 d, in seconds or like 90s, 10m, 1h30m, 1d; got {value!r}",
            )
            return 0
        return seconds

    def _overload(self, block: MarkedMapping, where: str, unlimited: bool, algorithm: Algorithm | None) -> bool:
        """``overload`` (an extension): ``suppress`` admits a steady fraction of an overload
        (:mod:`sidecar.limiter.suppression`); ``refuse``, the default, refuses once the window is full."""
        if "overload" not in block:
            return False
        value, line, field = block["overload"], block.line_of("overload"), f"{where}.overload"
        if value not in OVERLOAD_CHOICES:
            self._issue(line, field, f"must be one of {', '.join(OVERLOAD_CHOICES)}, got {value!r}")
            return False
        if value == "refuse":
            return False
        if unlimited:
            self._issue(line, field, "must not be set when unlimited (nothing is refused)")
        elif algorithm is Algorithm.TOKEN_BUCKET:
            self._issue(
                line, field, "suppress only applies to windows (fixed_window, sliding_window), not to a token_bucket"
            )
        return algorithm is not Algorithm.TOKEN_BUCKET and not unlimited

    def _name(self, block: MarkedMapping, where: str) -> str | None:
        if "name" not in block:
            return None
        name = block["name"]
        if not isinstance(name, str) or not name:
            self._issue(block.line_of("name"), f"{where}.name", "must be a non-empty string (remove it for no name)")
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
                self._issue(
                    ref_line or line,
                    field,
                    unknown_replace(name),
                )

    def _unknown_fields(self, mapping: MarkedMapping, allowed: frozenset[str], path: str) -> None:
        for key in mapping:
            if key not in allowed:
                where = f"{path}.{key}" if path else str(key)
                expected = ", ".join(sorted(allowed))
                self._issue(
                    mapping.line_of(key), where, f"unknown field (expected one of {expected}): fix or remove it"
                )

    def _issue(self, line: int, path: str, message: str) -> None:
        self.issues.append(ConfigIssue(self.file, line, path, message))


def parse_duration(value: Any) -> int | None:
    """Seconds in a whole number or a text such as ``10m`` or ``1h30m``; None if it is neither."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and DURATION.fullmatch(value.strip()):
        return sum(int(number) * DURATION_UNITS[unit] for number, unit in DURATION_PART.findall(value))
    return None


JSON_SCALARS = (str, int, float, bool, type(None))


def json_problem(value: Any, *, top: bool = False, depth: int = 0) -> str | None:
    """Why ``value`` is not a JSON object (``top``) or value, or None when it is."""
    problem: str | None = None
    if depth > MAX_DEPTH:
        problem = f"nested deeper than {MAX_DEPTH}"
    elif isinstance(value, dict):
        keys = [key for key in value if not isinstance(key, str)]
        problem = f"keys must be strings, got {keys[0]!r}" if keys else None
        items = list(value.values())
    elif top:
        problem = f"must be a mapping, got {type(value).__name__}"
    elif isinstance(value, list):
        items = value
    elif not isinstance(value, JSON_SCALARS):
        problem = f"holds a {type(value).__name__}, which is not a JSON value (quote it)"
    if problem is None and isinstance(value, dict | list):
        problem = next((found for found in (json_problem(item, depth=depth + 1) for item in items) if found), None)
    return problem


def plain_json(value: Any) -> Any:
    """``value`` with :class:`MarkedMapping` turned into plain dicts."""
    if isinstance(value, dict):
        return {key: plain_json(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain_json(item) for item in value]
    return value


def unknown_replace(name: str) -> str:
    """The issue of a ``replaces`` entry naming no rule (a check envoyproxy/ratelimit does not make)."""
    return (
        f"no rate_limit in this domain is named {name!r}: it would replace nothing (fix the name, or remove the entry)"
    )
