"""``serve`` refusing a setting, run in the test's own process through the command line's path.

A value ``serve`` refuses never reaches the event loop: ``main(["serve", ...])`` parses the
flags with the console script's parser, resolves them against the environment
(:func:`sidecar.settings.resolve_with_notes`), and :func:`sidecar.server.serve` checks what
only it can (the addresses bind, redis-py takes the URL) before it loads the config; either
refusal ends in one ``ratelimit-sidecar: error:`` line. Doing that here costs milliseconds
where a real ``serve`` process costs about a CPU-second (interpreter start, grpc and uvloop
imports), so tests check every bad value in-process and keep one real process per path to
prove the exit itself.

:func:`cli_in_process` runs any other command (``check-config``, ``query``, ``health``) the
same way: its parsing, messages and exit code need no process of their own either.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import warnings
from collections.abc import Coroutine, Iterator, Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, NoReturn
from unittest import mock

import structlog

import sidecar.__main__ as cli
from sidecar import server
from tests.support.sidecars import clean_env


@dataclass(frozen=True)
class Refusal:
    """What ``serve`` (or another command) gave back: its exit code and what it wrote."""

    code: int
    stdout: str
    stderr: str

    @property
    def lines(self) -> list[str]:
        """stderr's lines, as an operator sees them."""
        return self.stderr.strip().splitlines()


ACCEPTED = "serve() got past its startup checks to load the config: the value was accepted"


def _accepted(*_: object) -> NoReturn:
    """Stands for ``has_startup_config``, serve()'s first step past its checks (towards the
    config load), or with a config load for ``settle_after_load``, its first step past the
    load: reaching it fails the test."""
    raise AssertionError(ACCEPTED)


def _serving(main: Coroutine[Any, Any, None]) -> NoReturn:
    """Stands for ``uvloop.run``, in case serve() ever loads the config before a check."""
    main.close()
    raise AssertionError(ACCEPTED)


class _Lines(logging.Handler):
    """Writes records to a stream, as Python's last-resort handler writes them to stderr
    in a process whose logging is not configured yet (a refused setting stops before it is)."""

    def __init__(self, stream: io.StringIO) -> None:
        super().__init__(logging.WARNING)
        self.stream = stream

    def emit(self, record: logging.LogRecord) -> None:
        self.stream.write(self.format(record) + "\n")


@contextlib.contextmanager
def _stderr_of_a_process(stream: io.StringIO) -> Iterator[None]:
    """Warnings and log records at WARNING or above go to ``stream``, as a real process
    would print them on stderr: a refusal with one of them is no longer one line."""
    handler = _Lines(stream)
    logging.getLogger().addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        logging.getLogger().removeHandler(handler)
    for warning in caught:
        stream.write(warnings.formatwarning(warning.message, warning.category, warning.filename, warning.lineno))


@contextlib.contextmanager
def _logging_restored() -> Iterator[None]:
    """structlog's configuration as it was: serve configures logging to the stderr of the
    moment (here a StringIO), and every later test in this worker would log into it (a
    test reading its own log lines with capsys then read nothing)."""
    saved = structlog.get_config()
    try:
        yield
    finally:
        structlog.configure(**saved)


def serve_in_process(*args: str, env: Mapping[str, str] | None = None, load: bool = False) -> Refusal:
    """``python -m sidecar serve ARGS`` with ``clean_env(**env)`` as the environment, in this
    process. An exception ``serve`` lets escape (a real process's traceback) propagates; a
    value it accepts fails the test at the config load instead of starting a server. The
    gRPC address should bind (``127.0.0.1:0``): serve() checks it first.

    ``load``: the config is loaded too (for a refused config); a config that loads fails the
    test before serve() settles the heap (``gc.freeze``) or starts the event loop."""
    stop_at = "settle_after_load" if load else "has_startup_config"
    with (
        mock.patch.object(server, stop_at, _accepted),
        mock.patch.object(server, "uvloop", SimpleNamespace(run=_serving)),
    ):
        return cli_in_process("serve", *args, env=env)


def cli_in_process(*args: str, env: Mapping[str, str] | None = None) -> Refusal:
    """``python -m sidecar ARGS`` with ``clean_env(**env)`` as the environment, in this
    process: ``main``'s exit code and what it wrote (warnings and log records included);
    structlog's configuration and the environment are restored afterwards."""
    out, err = io.StringIO(), io.StringIO()
    with (
        _logging_restored(),
        mock.patch.dict(os.environ, clean_env(**(env or {})), clear=True),
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
        _stderr_of_a_process(err),
    ):
        code = cli.main(list(args))
    return Refusal(code, out.getvalue(), err.getvalue())
