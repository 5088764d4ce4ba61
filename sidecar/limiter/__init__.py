"""The decision: window arithmetic, the Limiter protocol and its backends."""

from sidecar.limiter.protocol import Check, Decision, Limiter, Role

__all__ = ["Check", "Decision", "Limiter", "Role"]
