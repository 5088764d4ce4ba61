"""Descriptor config: parsing and validation, the match tree, loading files and directories."""

from sidecar.config.errors import ConfigError, ConfigIssue
from sidecar.config.load import LoadOptions, load_config
from sidecar.config.match import Match, match_descriptor
from sidecar.config.model import DomainConfig, RateLimitConfig, RateLimitRule

__all__ = [
    "ConfigError",
    "ConfigIssue",
    "DomainConfig",
    "LoadOptions",
    "Match",
    "RateLimitConfig",
    "RateLimitRule",
    "load_config",
    "match_descriptor",
]
