"""Descriptors onto rules, and the plan: which rules are exported, in which tables and slots,
on which stick counters and under which conditions (:class:`Planner`); :mod:`.render` writes it."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from sidecar.config.model import UNIT_BY_SECONDS, DescriptorNode, DomainConfig, Level, RateLimitRule
from sidecar.export.haproxy.fit import ban_problem, keeps_previous_window, rule_problem
from sidecar.export.haproxy.model import (
    DEFAULT_TABLE_SIZE,
    FLAGS_ROUTE,
    MAX_SLOTS,
    TRACKERS,
    Condition,
    Const,
    Flavour,
    Producer,
    Source,
    Sources,
    Test,
)
from sidecar.export.haproxy.words import SAFE_CONSTANT, hint_of, patterns, unquotable, wildcard_test
from sidecar.export.problems import Problem
from sidecar.export.rules import landing_nodes, node_limits, where_of


@dataclass(frozen=True, slots=True)
class Target:
    """A rule one producer's descriptor lands on, with the tests selecting that branch of the tree."""

    rule: RateLimitRule
    route: int
    condition: Condition
    """The producer's presence tests and the branch tests (not the route's)."""
    key: tuple[Source, ...]
    """The values that make the counter key, as :func:`match_descriptor` collects them."""


def targets_of(domain: DomainConfig, route: int, producer: Producer) -> list[Target]:
    """Every rule the producer's descriptor can land on, replaying the match walk with unknown values."""
    found: list[Target] = []
    last = len(producer.entries) - 1

    def walk(level: Level, index: int, condition: Condition, key: tuple[Source, ...]) -> None:
        name, source = producer.entries[index]
        for node, tests in candidates(level, name, source):
            held = (*condition, *tests)
            values = (*key, source) if node.counts_each_value else key
            if index < last:
                walk(node.children, index + 1, held, values)
            else:
                # Every limit of the node (``rate_limits``): each its own counter, checked together.
                found.extend(Target(rule, route, held, values) for rule in node_limits(node))

    walk(domain.root, 0, producer.condition, ())
    return found


def candidates(level: Level, key: str, source: Source) -> list[tuple[DescriptorNode, Condition]]:
    """The nodes an entry can land on (:func:`landing_nodes`) and the ACL tests selecting each: an
    exact value's own test; a wildcard's, after none of the earlier ones held; the key-only default
    when none held."""
    if isinstance(source, Const):
        return [(node, ()) for node in landing_nodes(level, key, source.value)]
    earlier: list[Test] = []
    found: list[tuple[DescriptorNode, Condition]] = []
    for node in landing_nodes(level, key, None):
        if node.value is None:
            found.append((node, tuple(earlier)))
        elif node.wildcard is None:
            test = Test(f"{source.sample} -m str {patterns([node.value])}", hint_of(f"{key}_is_{node.value}"))
            found.append((node, (test,)))
            earlier.append(test.negate())
        else:
            test = wildcard_test(source.sample, node.value, hint_of(f"{key}_like_{node.value}"))
            found.append((node, (*earlier, test)))
            earlier.append(test.negate())
    return found


def slot_problem(taken: set[int], rule_id: int) -> str | None:
    """Take a slot in the table of the rule's window length, or say why there is none left."""
    if rule_id not in taken and len(taken) >= MAX_SLOTS:
        return f"more than {MAX_SLOTS} rules with this window: a HAProxy gpc array holds {MAX_SLOTS} counters"
    taken.add(rule_id)
    return None


def source_problem(source: Source) -> str | None:
    """Why a key part cannot be written into a ``concat`` argument, or None."""
    if isinstance(source, Const) and not SAFE_CONSTANT.fullmatch(source.value):
        return f"constant value {source.value!r} in the counter key needs quoting the exporter does not do"
    return None


# ---------------------------------------------------------------- the plan


@dataclass(frozen=True, slots=True)
class ExportOptions:
    """How to export: flavour, table size, optional peers section, the command for the header."""

    flavour: Flavour = "fixed"
    table_size: str = DEFAULT_TABLE_SIZE
    peers: str | None = None
    command: str = ""


@dataclass(frozen=True, slots=True)
class Table:
    """One stick table per window length; each rule with that window owns one counter slot.

    The bans table (``seconds`` 0) holds one ``gpt`` slot per rule with a ``ban_duration``.
    """

    name: str
    seconds: int
    rules: tuple[int, ...]
    """Rule ids in slot order."""
    keeps_previous: bool = False
    """Entries live one window past their end (rates, or a sliding_window rule reading the previous window)."""

    def slot(self, rule_id: int) -> int:
        return self.rules.index(rule_id)


GroupKey = tuple[int, tuple[Source, ...]]
"""``(window seconds, key parts)``: targets with equal group keys share one table entry and tracker."""
BanKey = tuple[Source, ...]
"""The key parts of a ban entry: no window, since a ban outlives windows."""


@dataclass(frozen=True, slots=True)
class Placed:
    """A target that made it into the output: its rule id, tracker and conditions."""

    target: Target
    rule_id: int
    tracker: int
    group: int
    condition: Condition
    """The target's condition and, for a replaceable rule, the 'not replaced' test; no route test."""
    ban: tuple[int | None, int] | None = None
    """``(tracker, ban group)`` of the rule's ban entry, when its ``ban_duration`` is exported; the
    tracker that starts a ban is None on a route with none left (it only enforces running bans)."""


@dataclass(frozen=True, slots=True)
class Merged:
    """What the output says about one rule on one tracker: the routes are folded into ``condition``."""

    rule: RateLimitRule
    rule_id: int
    tracker: int
    group: int
    condition: Condition
    ban: tuple[int | None, int] | None = None


class Planner:
    """Decides tables, trackers and conditions; :class:`Renderer` writes them out."""

    def __init__(self, domain: DomainConfig, sources: Sources, options: ExportOptions) -> None:
        self.domain = domain
        self.sources = sources
        self.options = options
        self.rule_ids = {id(rule): index for index, rule in enumerate(domain.rules)}
        self.problems: list[Problem] = list(sources.problems)
        self.targets = [
            target
            for route_index, route in enumerate(sources.routes)
            for producer in route.producers
            for target in targets_of(domain, route_index, producer)
        ]
        self.replacers = self._replacers()
        self.groups: list[GroupKey] = []
        self.ban_groups: list[BanKey] = []
        self.banned: tuple[int, ...] = ()
        """Rule ids whose ban is exported, in gpt slot order."""
        self.placed = self._place()
        self.tables = self._tables()
        self.bans = self._bans_table()
        self._report_unreached()

    def rule_id(self, rule: RateLimitRule) -> int:
        return self.rule_ids[id(rule)]

    def route_test(self, routes: Iterable[int]) -> Condition:
        """The test that the request took one of ``routes``: one ACL, as its patterns are alternatives."""
        chosen = sorted(set(routes))
        if all(route.match is None for route in self.sources.routes):
            return ()
        if len(chosen) == len(self.sources.routes):
            return (Test("var(txn.rl_route) -m found", "routed"),)
        numbers = " ".join(map(str, chosen))
        return (Test(f"var(txn.rl_route) -m int {numbers}", "route" + "_".join(map(str, chosen))),)

    def base_condition(self, target: Target) -> Condition:
        return (*self.route_test([target.route]), *target.condition)

    def merged(self) -> list[Merged]:
        """Placed targets that differ only by route, as one item with a test for all their routes."""
        routes: dict[tuple[int, int, int, Condition, tuple[int | None, int] | None], list[int]] = {}
        for item in self.placed:
            key = (item.rule_id, item.tracker, item.group, item.condition, item.ban)
            routes.setdefault(key, []).append(item.target.route)
        return [
            Merged(self.domain.rules[rule_id], rule_id, tracker, group, (*self.route_test(on), *condition), ban)
            for (rule_id, tracker, group, condition, ban), on in routes.items()
        ]

    def _replacers(self) -> dict[str, list[Target]]:
        """For each replaced rule name, the targets whose rule replaces it (the sidecar drops replaced
        limits from the whole request, whether the replacing rule is itself enforced or not)."""
        replacers: dict[str, list[Target]] = {}
        for target in self.targets:
            for name in sorted(target.rule.replaces):
                replacers.setdefault(name, []).append(target)
        return replacers

    def replaced_test(self, rule: RateLimitRule) -> Condition:
        if rule.name is None or rule.name not in self.replacers:
            return ()
        index = sorted(self.replacers).index(rule.name)
        return (Test(f"var(txn.rl_replaced{index}) -m found", f"replaced{index}", negated=True),)

    def _place(self) -> list[Placed]:
        """Give each exportable target its group and tracker, per route in descriptor order.

        Shadow rules come last: when a route runs out of trackers, a rule that only reports
        loses its counter rather than one that enforces a limit.
        """
        placed: list[Placed] = []
        refused: set[int] = set()
        trackers: dict[int, dict[tuple[str, int], int]] = {}
        """Per route: ("count", group) or ("ban", ban group) -> tracker, in order of first use."""
        slots: dict[int, set[int]] = {}
        """Per window length: the rules with a slot in its table."""
        for target in sorted(self.targets, key=lambda target: target.rule.shadow_mode):
            rule = target.rule
            rule_id = self.rule_id(rule)
            if rule.unlimited:
                continue
            reason = (
                rule_problem(rule, self.options.flavour)
                or next(filter(None, map(source_problem, target.key)), None)
                or slot_problem(slots.setdefault(rule.unit_seconds, set()), rule_id)
            )
            if reason is not None:
                if rule_id not in refused:
                    refused.add(rule_id)
                    self.problems.append(Problem(where_of(rule), reason))
                continue
            group = self._group((rule.unit_seconds, target.key))
            on_route = trackers.setdefault(target.route, {})
            tracker = on_route.setdefault(("count", group), len(on_route))
            if tracker >= TRACKERS:
                self._tracker_problem(target)
                continue
            condition = (*target.condition, *self.replaced_test(rule))
            placed.append(Placed(target, rule_id, tracker, group, condition))
        placed = self._place_bans(placed, trackers)
        self._note_differences(placed)
        return placed

    def _place_bans(self, placed: list[Placed], trackers: dict[int, dict[tuple[str, int], int]]) -> list[Placed]:
        """Give each placed rule with a ``ban_duration`` its ban entry, and the tracker that starts a ban.

        After every counter has its tracker: a route short of trackers loses a ban rather than a
        limit. Reading a ban needs no tracker (``table_gpt``), so such a route still refuses a
        client banned through another route; when no route can start the rule's ban, it is not
        exported. A ban entry is keyed by the values alone (a ban outlives the windows), one
        ``gpt`` slot per rule, so rules with the same values share an entry and a tracker.
        """
        keys: list[BanKey] = []
        chosen: list[tuple[Placed, int | None, int | None]] = []
        """Each item with its ban tracker (None: read only) and key index, or no ban at all."""
        starts: set[int] = set()
        for item in placed:
            rule = item.target.rule
            reason = ban_problem(rule) if rule.ban_seconds else None
            if not rule.ban_seconds or reason is not None:
                if reason is not None:
                    self._note_once(rule, reason)
                chosen.append((item, None, None))
                continue
            if item.target.key not in keys:
                keys.append(item.target.key)
            index = keys.index(item.target.key)
            on_route = trackers.setdefault(item.target.route, {})
            tracker = on_route.get(("ban", index))
            if tracker is None and len(on_route) < TRACKERS:
                tracker = on_route[("ban", index)] = len(on_route)
            if tracker is not None:
                starts.add(item.rule_id)
            chosen.append((item, tracker, index))
        banned = sorted(starts)[:MAX_SLOTS]
        result: list[Placed] = []
        for item, tracker, key in chosen:
            rule = item.target.rule
            if key is None:  # no ban, or one that cannot be exported at all
                result.append(item)
                continue
            if item.rule_id not in banned:
                why = (
                    f"more than {MAX_SLOTS} rules with a ban, and a HAProxy gpt array holds {MAX_SLOTS}"
                    if item.rule_id in starts
                    else f"starting a ban needs a stick counter beyond sc{TRACKERS - 1} for its entry (keyed by "
                    "the values, without the window) on every route that reaches it"
                )
                self._note_once(rule, f"ban_duration not exported (the limit is): {why}")
                result.append(item)
                continue
            if tracker is None:
                label = self.sources.routes[item.target.route].label
                self._note_once(
                    rule,
                    f"on {label}: a running ban is enforced, but no ban starts here: that needs a stick counter "
                    f"beyond sc{TRACKERS - 1} for the ban entry (keyed by the values, without the window)",
                )
            result.append(replace(item, ban=(tracker, self._ban_group(keys[key]))))
        self.banned = tuple(banned)
        return result

    def _note_once(self, rule: RateLimitRule, reason: str) -> None:
        problem = Problem(where_of(rule), reason, exported=True)
        if problem not in self.problems:
            self.problems.append(problem)

    def _group(self, key: GroupKey) -> int:
        if key not in self.groups:
            self.groups.append(key)
        return self.groups.index(key)

    def _ban_group(self, key: BanKey) -> int:
        if key not in self.ban_groups:
            self.ban_groups.append(key)
        return self.ban_groups.index(key)

    def _tracker_problem(self, target: Target) -> None:
        label = self.sources.routes[target.route].label
        reason = (
            f"on {label}: needs a stick counter beyond sc{TRACKERS - 1}; HAProxy 2.6 tracks "
            f"sc0..sc{TRACKERS - 1} per request (rules sharing key values and window share one)"
        )
        if label == FLAGS_ROUTE:
            reason += "; Envoy routes (--envoy) keep descriptors of different routes apart"
        self.problems.append(Problem(where_of(target.rule), reason))

    def _note_differences(self, placed: Sequence[Placed]) -> None:
        """Notes for rules exported with a documented difference: shadow mode, soft limits, bans,
        repeated descriptors."""
        seen: dict[tuple[int, int, tuple[Source, ...]], int] = {}
        for item in placed:
            slot = (item.target.route, item.rule_id, item.target.key)
            seen[slot] = seen.get(slot, 0) + 1
        noted: set[int] = set()
        soft_noted: set[int] = set()
        ban_noted: set[int] = set()
        for item in placed:
            rule = item.target.rule
            if rule.shadow_mode and item.rule_id not in noted:
                noted.add(item.rule_id)
                self.problems.append(
                    Problem(
                        where_of(rule),
                        "shadow_mode: counted like the sidecar but never denied; a request over it "
                        f"gets /r{item.rule_id} in the txn.rl_shadow variable (log it with %[var(txn.rl_shadow)])",
                        exported=True,
                    )
                )
            if rule.warn_at is not None and item.rule_id not in soft_noted:
                soft_noted.add(item.rule_id)
                self.problems.append(
                    Problem(
                        where_of(rule),
                        f"warn_at {rule.warn_at:g}: the limit is exported, the soft limit is not "
                        "(HAProxy sends no warning header)",
                        exported=True,
                    )
                )
            if item.ban is not None and item.rule_id not in ban_noted:
                ban_noted.add(item.rule_id)
                self.problems.append(
                    Problem(
                        where_of(rule),
                        f"ban_duration {rule.ban_seconds} s: set by the request that goes over, never extended, "
                        "kept as its end in whole Unix seconds rounded up (it can last up to 1 s longer than "
                        "in the sidecar)",
                        exported=True,
                    )
                )
        for (route, rule_id, _), count in seen.items():
            if count > 1:
                rule = self.domain.rules[rule_id]
                label = self.sources.routes[route].label
                self.problems.append(
                    Problem(
                        where_of(rule),
                        f"on {label}: {count} descriptors may land on it; HAProxy checks for room for one hit, "
                        f"the sidecar for {count} (the limit can be passed by {count - 1})",
                        exported=True,
                    )
                )

    def _tables(self) -> list[Table]:
        by_window: dict[int, list[int]] = {}
        for item in self.placed:
            ids = by_window.setdefault(item.target.rule.unit_seconds, [])
            if item.rule_id not in ids:
                ids.append(item.rule_id)
        name = self._table_prefix()
        tables = []
        for seconds in sorted(by_window):
            rule_ids = tuple(sorted(by_window[seconds]))
            unit = UNIT_BY_SECONDS.get(seconds)
            label = unit.name.lower() if unit is not None else f"{seconds}s"
            keeps = any(keeps_previous_window(self.domain.rules[i], self.options.flavour) for i in rule_ids)
            tables.append(Table(f"{name}_{label}", seconds, rule_ids, keeps))
        return tables

    def _bans_table(self) -> Table | None:
        """The table of ban ends, one ``gpt`` slot per rule whose ban is exported."""
        if not self.banned:
            return None
        return Table(f"{self._table_prefix()}_bans", 0, self.banned)

    def _table_prefix(self) -> str:
        return f"rl_{re.sub(r'[^A-Za-z0-9_.-]', '_', self.domain.name)}_{self.options.flavour}"

    def table_of(self, rule_id: int) -> Table:
        return next(table for table in self.tables if rule_id in table.rules)

    def _report_unreached(self) -> None:
        reached = {self.rule_id(target.rule) for target in self.targets}
        reported = {problem.where for problem in self.problems}
        for index, rule in enumerate(self.domain.rules):
            if index in reached or where_of(rule) in reported:
                continue
            reason = f"no descriptor that {self.sources.origin} sends lands on it (nothing to enforce)"
            if unquotable(rule.stat_key):
                reason = "its path holds a value with a line break: no config line (and no HTTP request) carries it"
            self.problems.append(Problem(where_of(rule), reason))
