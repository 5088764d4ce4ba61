"""Everything that talks to Redis, for the ``sync`` and ``strict`` backends.

``connect`` turns a URL (plain, TLS, Cluster, Sentinel) into a client; ``availability``
tracks whether Redis answers and probes it back; ``store`` makes the calls (decisions,
flushes, heartbeats) through ``scripts`` and the ``lua/`` files; ``keys`` spells every
key collision-free; ``batcher`` coalesces the calls of one loop iteration; ``replicas``
counts live replicas from heartbeats; ``clock`` takes Redis ``TIME`` as the shared clock.
Nothing outside ``sidecar.limiter`` and ``sidecar.server`` imports from here.
"""
