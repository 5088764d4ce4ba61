"""Export rate-limit rules to HAProxy 2.6: stick tables, ``track-sc`` rules and 429 denials.

Some pods run HAProxy rather than Envoy, and the comparison harness runs both, so
the same limits must be enforceable by HAProxy alone. The descriptor config does not
say how a request becomes descriptors: the proxy decides that. So the exporter reads
the Envoy config's route ``rate_limits`` (``--envoy``) and replays them as HAProxy
rules; without Envoy, ``--fetch``/``--when`` flags say where each key's value comes
from. Whatever cannot be translated faithfully is listed on stderr with the reason:
a rule is never left out silently.

Two flavours:

``fixed``
    The sidecar's windows exactly: the key of a counter carries the window number
    (``date`` divided by the window length), so counts restart at the same wall-clock
    boundaries as in every sidecar replica.
``sliding``
    HAProxy's own rate counters (``gpc_rate`` over the window length): a rate over
    the last period, which HAProxy estimates from the current period's count plus the
    previous one's weighted by the part of the period still to come. Not clock-aligned:
    no burst of twice the limit across a boundary, but the estimate assumes the previous
    period's hits were spread evenly, so after a quiet period a burst followed by a flood
    can pass close to twice the limit in one window-long span (measured: 36 in one second
    at 20/s, ``loadtest/compare.py``), and the counts are not the sidecar's.

Both count *admitted* requests only (``sc-inc-gpc`` after every check, never
``http_req_rate``, which also counts the requests it denies: a client flooding
above the limit would never get through again), and a request is all-or-nothing like
in the sidecar: every check runs before any counter is incremented, so a request
refused by one limit spends nothing from the others.

The config extensions: a window of ``unit_multiplier`` units is just another window
length (its own table); every limit of a ``rate_limits`` node is one more rule (a slot,
and a tracker when its window differs); a ``sliding_window`` rule of the fixed flavour
adds the previous clock window's weighted count (``table_gpc`` on the previous window's
key), which is the sidecar's estimate, where ``gpc_rate`` would start its periods at an
entry's first count; a ``ban_duration`` is the ban's end in a ``gpt`` slot of a bans
table keyed without the window, written by the request that goes over (its own tracker)
and read with ``table_gpt``. A ``token_bucket`` has no HAProxy 2.6 counterpart and is
listed.

Modules, each importing only those above it and the exporters' shared ones in
:mod:`sidecar.export` (``problems``, ``envoy_routes``, ``rules``):

``model``
    The vocabulary: :class:`Fetch`/:class:`Const` sources, :class:`Test` ACLs, :class:`Producer`,
    :class:`Route`, :class:`Sources`, and HAProxy 2.6's limits (``TRACKERS``, ``MAX_SLOTS``,
    ``KEY_LENGTH``, ...).
``words``
    HAProxy config words: quoting, ACL patterns, anchored regexes, comment-safe text, ACL name hints.
``fit``
    Whether one descriptor-config rule fits HAProxy 2.6 (``rule_problem``, ``ban_problem``), and its
    rate and window text.
``routes``
    The Envoy config's routes as :class:`Sources` (``sources_from_envoy``, ``EnvoyReader``, route and
    header matchers as ACLs).
``flags``
    Reading ``--fetch``/``--when`` into :class:`Sources` instead (``sources_from_flags``).
``plan``
    Descriptors onto rules (``targets_of``) and the :class:`Planner`: tables, slots, trackers, bans,
    conditions, and the problems found on the way.
``render``
    The :class:`Renderer`: the plan as config lines (``AclNames`` names the ACLs).
``export``
    :func:`export` (plan, then render) and the ``export-haproxy`` command line (``run_export``).

The names callers use are re-exported here.
"""

from sidecar.export.envoy_routes import rate_limited_manager, read_envoy
from sidecar.export.haproxy.export import Export, add_export_arguments, export, run_export
from sidecar.export.haproxy.flags import sources_from_flags
from sidecar.export.haproxy.model import (
    KEY_LENGTH,
    MAX_SLOTS,
    TRACKERS,
    Const,
    Fetch,
    Flavour,
    Producer,
    Route,
    Sources,
    Test,
)
from sidecar.export.haproxy.plan import ExportOptions
from sidecar.export.haproxy.routes import (
    EnvoyReader,
    header_tests,
    header_value_match,
    route_test,
    sources_from_envoy,
)
from sidecar.export.haproxy.words import patterns, quote
from sidecar.export.problems import ExportError, Problem

__all__ = [
    "KEY_LENGTH",
    "MAX_SLOTS",
    "TRACKERS",
    "Const",
    "EnvoyReader",
    "Export",
    "ExportError",
    "ExportOptions",
    "Fetch",
    "Flavour",
    "Problem",
    "Producer",
    "Route",
    "Sources",
    "Test",
    "add_export_arguments",
    "export",
    "header_tests",
    "header_value_match",
    "patterns",
    "quote",
    "rate_limited_manager",
    "read_envoy",
    "route_test",
    "run_export",
    "sources_from_envoy",
    "sources_from_flags",
]
