"""The local stack: redis-server, sidecars, Envoys, HAProxy and a sample upstream on 127.0.0.1.

The ONE place that starts real processes: ``processes.py`` (``spawn``, ``Child``, the
group that stops them), ``redis.py`` (redis-server: plain, TLS, ACL, Cluster, Sentinel),
``sidecar.py`` (``python -m sidecar serve``), ``envoy.py``, ``haproxy.py``,
``upstream.py`` (the sample app), ``tls.py`` (certificates), ``topology.py`` and
``demo.py`` (the demo's whole stack). Not part of the installed ``sidecar`` package: the
demo (``scripts/demo``), the tests and the load tools use it from the repository checkout.
"""
