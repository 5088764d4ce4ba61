"""The per-request path, one module per step in the order a call runs through them.

``servicer`` (the gRPC method: parse, match, check, answer) -> ``validate`` (bounds of
the request, ``INVALID_ARGUMENT`` naming the part) -> the match tree in
``sidecar.config.match`` -> the limiter -> ``reported`` (which limit each status and
the ``RateLimit-*`` headers report) -> ``headers`` -> ``wire`` (the response bytes).
"""
