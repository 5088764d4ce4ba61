"""What an export could not do: nothing at all (:class:`ExportError`), or one thing (:class:`Problem`).

Both exporters translate what they can and list the rest on stderr, one line each, with the
place in the config and the reason: a rule or a descriptor is never left out silently.
"""

from __future__ import annotations

from dataclasses import dataclass


class ExportError(Exception):
    """The inputs cannot be exported at all (unreadable Envoy config, unknown domain, bad flag)."""


@dataclass(frozen=True, slots=True)
class Problem:
    """Something not exported (``exported=False``) or exported with a difference (a note)."""

    where: str
    reason: str
    exported: bool = False

    def __str__(self) -> str:
        return f"{'note' if self.exported else 'not exported'}: {self.where}: {self.reason}"
