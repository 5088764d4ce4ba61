"""The loaded, validated config: rules and the match tree they hang from.

Built once per (re)load and never mutated afterwards, so the request path can read
it without locks and a reload swaps one reference.
"""

from __future__ import annotations

import functools
import json
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from sidecar.limiter.algorithms import Algorithm
from sidecar.limiter.protocol import Role
from sidecar.limiter.windows import CALENDAR_MONTH, UNIT_SECONDS, Unit

ValueMatcher = Callable[[str], bool]
UNIT_BY_SECONDS = {seconds: unit for unit, seconds in UNIT_SECONDS.items()}

# What a request may hold, beside the descriptors the rules match: checked before any work
# is done (sidecar.service.validate, the JSON API, quota bucket ids), so no request can make
# the sidecar allocate without limit or build an unbounded counter key. Documented in README.
MAX_DOMAIN_LENGTH = 256
MAX_DESCRIPTORS = 64
MAX_ENTRIES = 32
MAX_KEY_LENGTH = 256
MAX_VALUE_LENGTH = 4096
MAX_HITS = 2**32 - 1
"""Per-descriptor ``hits_addend`` is a uint64 in the proto; a hit count beyond uint32
is certainly a client bug and would overflow counters in stores with int64."""


@dataclass(frozen=True, slots=True)
class RateLimitRule:
    """A ``rate_limit`` block with the descriptor flags that change how it is enforced."""

    domain: str
    requests_per_unit: int
    unit: Unit | None
    unlimited: bool
    name: str | None
    replaces: frozenset[str]
    shadow_mode: bool
    quota_mode: bool
    detailed_metric: bool
    stat_key: str
    """``domain.key_value.key`` as envoyproxy/ratelimit names its stats."""
    counter_id: str
    """Stable identity of the rule's counters: same across replicas and reloads."""
    source: str
    """``file:line`` of the rule, for logs and ``/config``."""
    warn_at: float | None = None
    """Soft limit: admitted requests whose count reaches this fraction of the limit get a
    warning header and count as ``warned`` (an extension; None when not set)."""
    algorithm: Algorithm = Algorithm.FIXED_WINDOW
    unit_multiplier: int = 1
    """Windows of this many units, aligned to the epoch (an extension)."""
    burst: int = 0
    """Token bucket only: the bucket size (``limit`` of its checks)."""
    interval_us: int = 0
    """Token bucket only: microseconds per token, from the rate and the window."""
    ban_seconds: int = 0
    """``ban_duration``: how long a counter refuses everything once it went over."""
    where: str = ""
    """Path of the block inside its file (``descriptors[0].rate_limit``), for errors."""
    count_past: bool = False
    """``count_past_limit``: hits are always added, even past the limit and when the
    request is refused (response-phase costs); 0-hit checks then refuse until the window ends."""
    suppress: bool = False
    """``overload: suppress``: each request is admitted with a probability worked out from
    the attempted demand before the window check (:mod:`sidecar.limiter.suppression`)."""
    calendar: bool = False
    """A ``month`` window that is the UTC calendar month (``--calendar-months``)."""
    metadata: Mapping[str, object] | None = field(default=None, compare=False)
    """The descriptor's ``metadata`` (JSON values), returned as response dynamic metadata
    (``--response-dynamic-metadata``) when the descriptor passes."""
    values_in_stats: bool = False
    """``value_to_metric`` on some node of its path: the stat key holds request values."""
    unit_seconds: int = field(init=False, compare=False)
    """Window length (unit times multiplier); 0 for unlimited rules, which have no window."""
    limit: int = field(init=False, compare=False)
    """What a check of this rule is compared with: the bucket size or the window's limit."""
    role: Role = field(init=False, compare=False)
    """How its verdict takes part in a request's: shadow mode wins over quota mode."""

    def __post_init__(self) -> None:
        # Worked out once per (re)load: the request path reads them for every descriptor.
        seconds = self.unit.seconds * self.unit_multiplier if self.unit else 0
        if self.calendar:
            seconds = CALENDAR_MONTH
        limit = self.burst if self.algorithm is Algorithm.TOKEN_BUCKET else self.requests_per_unit
        role = Role.SHADOW if self.shadow_mode else Role.QUOTA if self.quota_mode else Role.ENFORCED
        object.__setattr__(self, "unit_seconds", seconds)
        object.__setattr__(self, "limit", limit)
        object.__setattr__(self, "role", role)

    @property
    def source_file(self) -> str:
        return self.source.rsplit(":", 1)[0]

    @property
    def source_line(self) -> int:
        return int(self.source.rsplit(":", 1)[1])

    @property
    def reported_unit(self) -> Unit | None:
        """The ``unit`` of ``current_limit``: the proto has no multiplier, so a window of
        N units that is exactly one larger unit (60 seconds, 24 hours, 7 days) is reported
        as that unit; any other multiple is reported in its configured unit (the window
        itself shows in ``duration_until_reset``)."""
        if self.unit is None or self.unit_multiplier == 1:
            return self.unit
        return UNIT_BY_SECONDS.get(self.unit_seconds, self.unit)


@dataclass(slots=True)
class DescriptorNode:
    """One ``descriptors`` entry: where a request entry lands in the tree."""

    key: str
    value: str | None
    rule: RateLimitRule | None
    children: Level
    wildcard: ValueMatcher | None = None
    share_threshold: bool = False
    more: tuple[RateLimitRule, ...] = ()
    """Further limits of the node (``rate_limits``), enforced together with :attr:`rule`."""
    value_to_metric: bool = False
    """Put the request's value of this entry in the stat key (envoyproxy/ratelimit's flag)."""

    @property
    def counts_each_value(self) -> bool:
        """Whether the request's value becomes part of the counter key at this level."""
        return self.value is None or (self.wildcard is not None and not self.share_threshold)


@dataclass(slots=True)
class Level:
    """The siblings at one depth, indexed the way matching looks them up."""

    exact: dict[tuple[str, str], DescriptorNode] = field(default_factory=dict)
    wildcards: dict[str, list[DescriptorNode]] = field(default_factory=dict)
    defaults: dict[str, DescriptorNode] = field(default_factory=dict)

    def add(self, node: DescriptorNode) -> None:
        """Index a node by how it matches: exact value, wildcard value, or key only."""
        if node.value is None:
            self.defaults[node.key] = node
        elif node.wildcard is not None:
            self.wildcards.setdefault(node.key, []).append(node)
        else:
            self.exact[(node.key, node.value)] = node

    def nodes(self) -> list[DescriptorNode]:
        """All siblings, for walking the tree outside the request path."""
        wild = [node for nodes in self.wildcards.values() for node in nodes]
        return [*self.exact.values(), *wild, *self.defaults.values()]


@dataclass(frozen=True, slots=True)
class DomainConfig:
    """All rules of one domain (one config file)."""

    name: str
    root: Level
    source: str
    rules: tuple[RateLimitRule, ...]
    line: int = 0
    """Line of the ``domain`` field in ``source``, for errors about the domain itself."""
    warns: bool = False
    """Whether any rule of the domain has ``warn_at``: the request path looks for soft
    limits only then."""
    replace_refs: tuple[tuple[str, str, int, str], ...] = ()
    """Every ``replaces`` name as ``(name, file, line, path)``: checked against the merged
    domain when files are merged (``--merge-domain-config``)."""
    sources: tuple[str, ...] = ()
    """Every file the domain was read from (several when merged); empty: just :attr:`source`."""


@dataclass(frozen=True, slots=True)
class RateLimitConfig:
    """Every domain the sidecar knows, plus what it was loaded from."""

    domains: Mapping[str, DomainConfig]
    files: tuple[str, ...]
    digest: str
    """SHA-256 of the loaded files' names and contents, to tell configs apart."""

    def summary(self) -> list[str]:
        """One human line per domain, as ``check-config`` prints it."""
        lines = []
        for name in sorted(self.domains):
            domain = self.domains[name]
            limited = sum(1 for rule in domain.rules if not rule.unlimited)
            lines.append(
                f"domain {name!r} ({domain.source}): {len(domain.rules)} rules, "
                f"{limited} limited, {len(domain.rules) - limited} unlimited"
            )
        return lines


def wildcard_matcher(pattern: str) -> ValueMatcher:
    """Compile a value with ``*`` wildcards (any run of characters, possibly empty).

    No regex: ``.*a.*a.*b`` backtracks in polynomial time of a degree that grows with
    the stars, and request values are up to 4096 characters, so one request could
    stall the event loop for minutes. With only ``*``, finding each literal part at
    its leftmost place after the previous one is exact, and costs a few ``str.find``.

    The matchers pickle (no closures): a config is handed whole to the quota worker process.
    """
    if "*" not in pattern:
        return functools.partial(operator.eq, pattern)
    if pattern.endswith("*") and pattern.count("*") == 1:
        return operator.methodcaller("startswith", pattern[:-1])
    head, *middle, tail = pattern.split("*")
    return WildcardMatcher(head, tuple(middle), tail)


@dataclass(frozen=True, slots=True)
class WildcardMatcher:
    """A value with inner ``*`` wildcards: ``head``, then each of ``middle`` in order, then ``tail``."""

    head: str
    middle: tuple[str, ...]
    tail: str

    def __call__(self, value: str) -> bool:
        head, tail = self.head, self.tail
        if len(value) < len(head) + len(tail) or not value.startswith(head) or not value.endswith(tail):
            return False
        position, end = len(head), len(value) - len(tail)
        for part in self.middle:
            found = value.find(part, position, end)
            if found < 0:
                return False
            position = found + len(part)
        return True


def counter_id(
    domain: str, seconds: int, path: list[tuple[str, str | None]], algorithm: Algorithm = Algorithm.FIXED_WINDOW
) -> str:
    """A stable, collision-free rule identity: JSON of domain, window (seconds), config
    path and, for the other algorithms, the algorithm (fixed windows keep the identity
    they had before algorithms existed, so an upgrade keeps their counters)."""
    parts: list[object] = [domain, seconds, path]
    if algorithm is not Algorithm.FIXED_WINDOW:
        parts.append(algorithm.label)
    return json.dumps(parts, ensure_ascii=False, separators=(",", ":"))


def stat_key(domain: str, path: list[tuple[str, str | None]]) -> str:
    """envoyproxy/ratelimit's stat name: ``domain.key_value.key``."""
    parts = [key if value is None else f"{key}_{value}" for key, value in path]
    return ".".join([domain, *parts])
