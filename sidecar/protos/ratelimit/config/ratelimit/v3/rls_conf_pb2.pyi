"""Typing stub: the generated module's names are built at import time, so they are Any."""

from typing import Any

def __getattr__(name: str) -> Any: ...
