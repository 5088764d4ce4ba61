"""Config errors that name the file, the line and the path inside the file."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ConfigIssue:
    """One thing wrong with a config; ``path`` is like ``descriptors[0].rate_limit.unit``."""

    file: str
    line: int
    path: str
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line else self.file
        return f"{where}: {self.path}: {self.message}" if self.path else f"{where}: {self.message}"


class ConfigError(Exception):
    """A config was refused as a whole; ``issues`` lists every reason."""

    def __init__(self, issues: list[ConfigIssue]) -> None:
        self.issues = issues
        count = len(issues)
        first = str(issues[0]) if issues else "no issues"
        more = f" (and {count - 1} more)" if count > 1 else ""
        super().__init__(f"invalid rate limit config: {first}{more}")
