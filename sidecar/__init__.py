"""Rate-limit sidecar for Envoy: local wall-clock windows, replicas kept consistent via Redis."""

__version__ = "0.1.0"
