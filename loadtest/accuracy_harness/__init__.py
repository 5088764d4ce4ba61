"""Pieces of the accuracy harness (``loadtest/accuracy.py``).

``processes``: redis-server and sidecar children; ``scenarios``: traffic shapes;
``driver``: the grpc.aio load generator (runs in its own process); ``redis_watch``:
reads the counters before they expire; ``analysis``: overshoot, false rejections,
round trips, latency; ``report``: Markdown table, goals and JSON.
"""
