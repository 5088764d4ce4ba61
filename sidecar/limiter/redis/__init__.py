"""Everything that talks to Redis, for the ``sync`` and ``strict`` backends and quota shares.

``connect`` turns a URL (plain, TLS, Cluster, Sentinel) into a client; ``availability``
tracks whether Redis answers and probes it back; ``store`` makes the calls (decisions,
flushes, heartbeats) through ``scripts`` and the ``lua/`` files; ``keys`` spells every
key collision-free; ``batcher`` coalesces the calls of one loop iteration; ``replicas``
counts live replicas from heartbeats; ``clock`` takes Redis ``TIME`` as the shared clock.
Outside ``sidecar.limiter``, only ``sidecar.server`` (which builds the stores),
``sidecar.settings`` (URL checks, without redis-py) and ``sidecar.quota`` (shares through
the same store and scripts) import from here; the import contracts in pyproject.toml say who
may not (the service, the config, the admin endpoint, the memory backend).
"""
