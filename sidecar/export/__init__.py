"""The offline exporters: the descriptor config and an Envoy config in, another proxy's config out.

Two commands, run by an operator or a build step, never by the serving process:

``export-haproxy`` (:mod:`sidecar.export.haproxy`)
    The same limits as HAProxy 2.6 stick tables, for pods that run HAProxy rather than Envoy.
``export-envoy-quota`` (:mod:`sidecar.export.envoy_quota`)
    The ``rate_limit_quota`` filters of quota mode, which sort requests into the buckets the
    sidecar assigns.

Both start from the same question: which descriptors does a request carry? The Envoy config's
route ``rate_limits`` say it. What they share lives here, each exporter importing only downwards:

``problems``
    :class:`ExportError` (nothing can be exported) and :class:`Problem` (one thing left out, or
    exported with a difference, listed on stderr: nothing is left out silently, and a limit
    left out fails the export unless ``--allow-dropped``).
``envoy_routes``
    Reading an Envoy config: the one HTTP connection manager with the ``ratelimit`` filter, its
    inline virtual hosts and routes, the ``rate_limits`` entries applied to each route (virtual
    host ones included), header matchers' string matches.
``hosts``
    Which requests Envoy gives each virtual host (exact domains, then wildcards, then ``*``),
    so that a host's limits are never applied to another host's requests.
``rules``
    The descriptor config as an exporter reads it: which domain, the limits of a tree node, which
    nodes an entry can land on, how a problem names a rule.

Nothing of the request path imports this package: ``server.py``, ``service/``, ``limiter/``,
``quota/`` and ``config/`` never look here, and ``envoy_quota`` (which loads envoy-data-plane and
pydantic) is imported by its command alone.
"""
