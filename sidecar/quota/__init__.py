"""Quota mode: Envoy's Rate Limit Quota Service (RLQS), driven by the descriptor config.

Envoy's ``rate_limit_quota`` filter sorts requests into buckets, enforces each bucket's
assignment in-process and reports usage on one long-lived stream; the sidecar maps each
bucket to a rule (:mod:`.buckets`, :mod:`.assignments`), keeps the assignments alive
(:mod:`.registry`) and serves the stream (:mod:`.service`). See docs/quota.md.
"""
