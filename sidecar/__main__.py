"""Command line: ``serve``, ``check-config``, ``query``, ``health``, ``export-haproxy`` and ``export-envoy-quota``.

Failures an operator can fix (bad config, port in use, bad flag) end with one line
on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

# gRPC's fork handlers serve a child that keeps using gRPC without exec; this process only
# forks to exec (the quota worker), where they would just log a line per start.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

import grpc
import structlog

from sidecar import __version__
from sidecar.addresses import StartupError
from sidecar.client import ClientTLS, Replaced, build_request, describe, health_status, query, replaced_rules
from sidecar.config import ConfigError, LoadOptions, load_config
from sidecar.export.haproxy.export import add_export_arguments, run_export
from sidecar.export.problems import ExportError
from sidecar.logs import configure_logging
from sidecar.server import serve
from sidecar.settings import Settings, SettingsError, add_serve_arguments, option_value, resolve_with_notes

PROG = "ratelimit-sidecar"
DEFAULT_ADDRESS = "127.0.0.1:8081"


def local_address(environ: Mapping[str, str] = os.environ) -> str:
    """Where this host's sidecar listens, read as ``serve`` reads it: ``RLS_GRPC_ADDRESS``,
    else the reference's ``GRPC_UDS`` or ``GRPC_HOST``/``GRPC_PORT``, else the default (a
    wildcard host means loopback). So ``health`` and ``query`` inside a container that
    moved the port need no ``--address``; :class:`SettingsError` for a value serve refuses."""
    configured = str(option_value("grpc_address", None, environ)).strip()
    host, _, port = configured.rpartition(":")
    if configured.startswith("unix:"):
        return configured
    return f"127.0.0.1:{port}" if host in ("0.0.0.0", "[::]", "::", "") else configured


def _address(arguments: argparse.Namespace) -> str:
    """``--address``, else :func:`local_address`."""
    return str(arguments.address) if arguments.address else local_address()


def _add_client_arguments(parser: argparse.ArgumentParser) -> None:
    """``--address`` and the TLS options shared by ``query`` and ``health``."""
    parser.add_argument(
        "--address",
        default=None,
        help="sidecar address, HOST:PORT or unix:PATH (default: where serve listens: RLS_GRPC_ADDRESS, "
        f"GRPC_UDS, GRPC_HOST/GRPC_PORT, else {DEFAULT_ADDRESS})",
    )
    parser.add_argument("--tls-ca", default="", help="PEM CA of a sidecar serving TLS (turns TLS on)")
    parser.add_argument("--tls-cert", default="", help="PEM client certificate, for mutual TLS")
    parser.add_argument("--tls-key", default="", help="PEM key of --tls-cert")


def _client_tls(arguments: argparse.Namespace) -> ClientTLS | None:
    return ClientTLS(arguments.tls_ca, arguments.tls_cert, arguments.tls_key) if arguments.tls_ca else None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Envoy rate-limit sidecar")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the gRPC RateLimitService")
    add_serve_arguments(serve)
    check = commands.add_parser("check-config", help="validate a config file or directory")
    check.add_argument("path", help="YAML file or directory of YAML files")
    check.add_argument(
        "--max-config-bytes",
        default=None,
        help="largest config file, in bytes, refused before it is read [env RLS_MAX_CONFIG_BYTES; "
        f"default {Settings.max_config_bytes}]",
    )
    check.add_argument(
        "--mode",
        choices=("memory", "sync", "strict"),
        default=None,
        help="also check what this backend mode can enforce (sync refuses token buckets)",
    )
    check.add_argument(
        "--merge-domain-config", action="store_true", help="merge files naming the same domain, as serve does with it"
    )
    check.add_argument("--calendar-months", action="store_true", help="read unit: month as the UTC calendar month")
    ask = commands.add_parser("query", help="ask a running sidecar about one request")
    _add_client_arguments(ask)
    ask.add_argument("--domain", required=True, help="rate limit domain")
    ask.add_argument(
        "--hits",
        type=int,
        default=0,
        help="hits_addend (0 means 1): a query spends them like the request it stands for",
    )
    ask.add_argument(
        "--config",
        default=None,
        help="the sidecar's descriptor config (default: serve's, from RLS_CONFIG or RUNTIME_ROOT ...): tells a "
        "rule `replaces` dropped from no match",
    )
    ask.add_argument(
        "descriptors",
        nargs="+",
        metavar="key=value[,key=value...]",
        help="one argument per descriptor",
    )
    probe = commands.add_parser("health", help="exit 0 when the sidecar reports SERVING")
    _add_client_arguments(probe)
    probe.add_argument("--service", default="", help="service name to check (default: overall)")
    haproxy = commands.add_parser(
        "export-haproxy",
        help="write HAProxy 2.6 stick tables and rules for a config's limits (problems on stderr)",
    )
    add_export_arguments(haproxy)
    quota = commands.add_parser(
        "export-envoy-quota",
        help="write Envoy rate_limit_quota filters putting requests in the buckets of quota mode (problems on stderr)",
    )
    _add_quota_arguments(quota)
    return parser


def _add_quota_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``export-envoy-quota`` (here: its module imports envoy-data-plane, which only it needs)."""
    parser.add_argument("config", nargs="?", help="descriptor config: a YAML file or a directory of them")
    parser.add_argument("--envoy", required=True, help="Envoy config whose route rate_limits say what requests send")
    parser.add_argument("--cluster", default="rlqs", help="cluster of the sidecar's gRPC port (default rlqs)")
    parser.add_argument(
        "--no-assignment",
        choices=("allow", "deny"),
        default="allow",
        help="before a bucket's first assignment, and once one expired: allow (default) or deny every request",
    )
    parser.add_argument("--full", action="store_true", help="print the whole Envoy config, ratelimit filter replaced")
    parser.add_argument(
        "--allow-dropped", action="store_true", help="export even when a limit cannot be translated (listed on stderr)"
    )
    parser.add_argument(
        "--per-request",
        action="append",
        metavar="ROUTE",
        help="keep this route (its name, or VHOST:INDEX) on the per-request ratelimit filter; repeatable",
    )
    parser.add_argument(
        "--per-request-untranslated",
        action="store_true",
        help="keep every route with a limit quota mode cannot express on the per-request ratelimit filter",
    )
    parser.add_argument(
        "--check", action="store_true", help="only check --envoy's rate_limit_quota filters (exit 1 when refused)"
    )


def _fail(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 1


def _serve(arguments: argparse.Namespace) -> int:
    try:
        settings, notes = resolve_with_notes(arguments)
    except SettingsError as error:
        return _fail(str(error))
    configure_logging(settings.log_level, settings.log_format)
    for variable, why in notes:
        structlog.get_logger(__name__).warning("reference_variable_ignored", variable=variable, reason=why)
    try:
        serve(settings)
    except StartupError as error:
        return _fail(str(error))
    return 0


def _check_config(
    path: str, mode: str | None = None, max_bytes: str | None = None, options: LoadOptions | None = None
) -> int:
    try:
        cap = option_value("max_config_bytes", max_bytes)
    except SettingsError as error:
        return _fail(str(error))
    try:
        config = load_config(path, mode, cap, options or LoadOptions())
    except ConfigError as error:
        for issue in error.issues:
            print(issue, file=sys.stderr)
        print(f"{len(error.issues)} error(s); config refused", file=sys.stderr)
        return 1
    for line in config.summary():
        print(line)
    return 0


def _query(arguments: argparse.Namespace) -> int:
    address = ""
    try:
        address = _address(arguments)
        request = build_request(arguments.domain, arguments.descriptors, arguments.hits)
        response = query(address, request, tls=_client_tls(arguments))
    except ValueError as error:  # SettingsError too
        return _fail(str(error))
    except OSError as error:
        return _fail(f"{error.filename}: {error.strerror}")
    except grpc.RpcError as error:
        return _fail(f"{address}: {error.code().name}: {error.details()}")
    print("\n".join(describe(response, _replaced(_config_path(arguments.config), request))))
    if any(status.HasField("current_limit") for status in response.statuses):
        # There is no dry run: the protocol counts a hits_addend of 0 as 1.
        print(
            f"(a query is a real request: it counted against the limits above, hits={max(arguments.hits, 1)})",
            file=sys.stderr,
        )
    return 0


def _config_path(flag: str | None) -> str:
    """``query --config``, else serve's config path when the environment names one (none is
    not an error here: the answer is printed without what the config would tell)."""
    if flag is not None:
        return flag
    try:
        return str(option_value("config", None) or "")
    except SettingsError:
        return ""


def _replaced(config_path: str, request: Any) -> dict[int, Replaced] | None:
    """What ``query --config`` can tell about rules ``replaces`` dropped; None without a
    usable config (a config that fails to load is named on stderr, the answer still printed)."""
    if not config_path:
        return None
    try:
        return replaced_rules(load_config(config_path), request)
    except ConfigError as error:
        print(f"{PROG}: --config {config_path}: {len(error.issues)} error(s), not used", file=sys.stderr)
        return None


def _health(arguments: argparse.Namespace) -> int:
    address = ""
    try:
        address = _address(arguments)
        status = health_status(address, arguments.service, tls=_client_tls(arguments))
    except SettingsError as error:
        return _fail(str(error))
    except OSError as error:
        return _fail(f"{error.filename}: {error.strerror}")
    except grpc.RpcError as error:
        return _fail(f"{address}: {error.code().name}: {error.details()}")
    print(status)
    return 0 if status == "SERVING" else 1


def _export_haproxy(arguments: argparse.Namespace) -> int:
    return _export(run_export, arguments)


def _export_envoy_quota(arguments: argparse.Namespace) -> int:
    # Imported here: envoy-data-plane (and pydantic) load for this command only, not for ``serve``.
    from sidecar.export.envoy_quota.export import run_quota_export  # noqa: PLC0415

    return _export(run_quota_export, arguments)


def _export(run: Callable[[argparse.Namespace], Any], arguments: argparse.Namespace) -> int:
    """Run an exporter: its text on stdout, what it could not translate on stderr, one
    line per config issue; exit 1 when the config is refused or the export failed."""
    try:
        result = run(arguments)
    except ConfigError as error:
        for issue in error.issues:
            print(f"{PROG}: error: {issue}", file=sys.stderr)
        return 1
    except ExportError as error:
        return _fail(str(error))
    sys.stdout.write(result.text)
    for problem in result.problems:
        print(problem, file=sys.stderr)
    return 1 if result.failed else 0


EXIT_BROKEN_PIPE = 128 + 13
"""What a shell reports for a program SIGPIPE ended: the reader (``| head -1``) left early."""


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ratelimit-sidecar`` console script."""
    try:
        code = _run(argv)
        sys.stdout.flush()  # here, not at exit: a closed pipe is then ours to handle
    except BrokenPipeError:
        # The reader went away (``query ... | head -1``): not an error of ours worth a traceback.
        # stdout is pointed at /dev/null so the interpreter's final flush cannot fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    return code


def _run(argv: Sequence[str] | None) -> int:
    arguments = _parser().parse_args(argv)
    if arguments.command == "serve":
        return _serve(arguments)
    if arguments.command == "check-config":
        options = LoadOptions(merge_domains=arguments.merge_domain_config, calendar_months=arguments.calendar_months)
        return _check_config(arguments.path, arguments.mode, arguments.max_config_bytes, options)
    if arguments.command == "query":
        return _query(arguments)
    if arguments.command == "export-haproxy":
        return _export_haproxy(arguments)
    if arguments.command == "export-envoy-quota":
        return _export_envoy_quota(arguments)
    return _health(arguments)


if __name__ == "__main__":
    sys.exit(main())
