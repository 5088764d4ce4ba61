"""Settings as ``serve`` resolves them from its command line, for tests that need a :class:`Settings`."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence

from sidecar.settings import Settings, add_serve_arguments, resolve


def settings_from(flags: Sequence[str], environ: Mapping[str, str] | None = None, *, config: str = "") -> Settings:
    """``serve``'s flags (``config``, when given, first as ``--config``) resolved against ``environ``
    (empty by default, never the test process's own environment)."""
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_serve_arguments(parser)
    argv = ["--config", config, *flags] if config else list(flags)
    return resolve(parser.parse_args(argv), environ or {})
