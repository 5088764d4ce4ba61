"""What an export could not do: nothing at all (:class:`ExportError`), or one thing (:class:`Problem`).

Both exporters translate what they can and list the rest on stderr, one line each, with the
place in the config and the reason: a rule or a descriptor is never left out silently. A
problem that leaves a limit out (``exported=False``) fails ``export-envoy-quota`` unless the
user accepts it with ``--allow-dropped``; a note (``exported=True``) says a difference.
"""

from __future__ import annotations

from dataclasses import dataclass


class ExportError(Exception):
    """The inputs cannot be exported at all (unreadable Envoy config, unknown domain, bad flag).

    ``reasons``: the problems that led there (each route and action left out), printed after
    the message, one line each, so that a refused export says why.
    """

    def __init__(self, message: str, reasons: tuple[Problem, ...] = ()) -> None:
        super().__init__(message)
        self.message = message
        self.reasons = reasons

    def __str__(self) -> str:
        return "".join([self.message, *(f"\n  {reason}" for reason in self.reasons)])


@dataclass(frozen=True, slots=True)
class Problem:
    """Something not exported (``exported=False``) or exported with a difference (a note)."""

    where: str
    reason: str
    exported: bool = False

    def __str__(self) -> str:
        return f"{'note' if self.exported else 'not exported'}: {self.where}: {self.reason}"


def refusal(command: str, dropped: int) -> str:
    """The last line of an export refused for the limits it would leave out."""
    return (
        f"{command}: error: {dropped} limit(s) or descriptor(s) above would be left out; nothing written. "
        "Change the config, or accept the loss with --allow-dropped"
    )


@dataclass(frozen=True, slots=True)
class Refusal(Problem):
    """The refusal itself, listed after the problems that caused it (printed as its reason alone)."""

    def __str__(self) -> str:
        return self.reason
