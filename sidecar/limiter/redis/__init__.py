"""Everything that talks to Redis, for the ``sync`` and ``strict`` backends and quota shares.

``connect`` turns a URL (plain, TLS, Cluster, Sentinel) into a client; ``availability``
tracks whether Redis answers and probes it back, ``faults`` says what a failed call tells
about it, ``cluster_health`` keeps that per Cluster master; ``store`` makes the calls (decisions,
flushes, heartbeats), every script call through one method, ``RedisStore.run_scripts``
(one pipeline, ``NOSCRIPT`` resent, one failure type; what it sends is in ``pipeline``
and ``flush_calls``),
with the ``lua/`` files of ``scripts``; ``corrupt`` notes keys that hold no counter;
``keys`` spells every key collision-free; ``batcher`` coalesces the decisions of one loop
iteration into one ``run_scripts`` call; ``replicas`` counts live replicas from
heartbeats; ``clock`` takes Redis ``TIME`` as the shared clock.
Outside ``sidecar.limiter``, only ``sidecar.server`` (which builds the stores),
``sidecar.settings`` (URL checks, without redis-py) and ``sidecar.quota`` (its
``share.lua`` through the same ``run_scripts``) import from here; the import contracts in
pyproject.toml say who may not (the service, the config, the admin endpoint, the memory
backend).
"""
