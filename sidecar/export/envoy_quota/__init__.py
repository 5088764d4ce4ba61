"""``export-envoy-quota``: the ``rate_limit_quota`` filters of quota mode, from the Envoy config's routes.

Imported by that command alone (``sidecar/__main__.py`` imports it lazily): :mod:`.objects` loads
envoy-data-plane and pydantic, which no other command pays for.

``routes``
    The Envoy routes as quota predicates and bucket values (:class:`RouteReader`).
``metadata``
    The ``metadata`` / ``dynamic_metadata`` actions: the route's metadata as a constant, dynamic
    metadata as one tested alternative per value the rules name (no input gives a bucket id its string).
``filters``
    Descriptors onto filters: one bucket per request and filter, so descriptors a route sends
    together go to different filters; matchers in route order.
``objects``
    The filter's Envoy objects, built with envoy-data-plane's typed classes.
``export``
    :func:`export_quota`, the whole-config rewrite (``--full``), the crash check (``--check``) and
    the command line.
"""
