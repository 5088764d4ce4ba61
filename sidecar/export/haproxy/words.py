"""HAProxy config words: quoting, ACL patterns and regexes, comment-safe text, ACL name hints."""

from __future__ import annotations

import re
from collections.abc import Sequence

from sidecar.export.haproxy.model import Test

_SAFE_WORD = re.compile(r"[A-Za-z0-9_.:/@%+=^~-]+")
SAFE_CONSTANT = re.compile(r"[A-Za-z0-9_.:/@=+~-]+")
"""Constants that may appear inside ``concat(...)`` without a second level of quoting."""
_LINE_BREAKS = re.compile(r"[\x00\n\r]")
CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def quote(word: str) -> str:
    """One config word, single-quoted when needed (no ``$`` expansion, no escapes inside)."""
    if _SAFE_WORD.fullmatch(word) and not word.startswith("-"):
        return word
    return "'" + word.replace("'", "'\\''") + "'"


def patterns(values: Sequence[str]) -> str:
    """ACL patterns; ``--`` first when one could be taken for a flag."""
    words = " ".join(quote(value) for value in values)
    return f"-- {words}" if any(value.startswith("-") for value in values) else words


def unquotable(value: str) -> bool:
    """True when ``value`` cannot be written into a config line (nor be read from an HTTP request)."""
    return _LINE_BREAKS.search(value) is not None


def printable(text: str) -> str:
    """``text`` for a comment line: control characters escaped, so a value cannot end the comment."""
    return CONTROL.sub(lambda found: f"\\x{ord(found.group()):02x}", text)


def full_regex(regex: str) -> str:
    """Envoy's RE2 matches the whole value; PCRE needs anchors for that."""
    return f"^(?:{regex})$"


def wildcard_test(sample: str, pattern: str, hint: str) -> Test:
    """The ACL for a config value with ``*`` wildcards, as :func:`wildcard_matcher` reads it."""
    if pattern.endswith("*") and pattern.count("*") == 1:
        return Test(f"{sample} -m beg {patterns([pattern[:-1]])}", hint)
    regex = "(?s)^" + ".*".join(re.escape(part) for part in pattern.split("*")) + "$"
    return Test(f"{sample} -m reg {quote(regex)}", hint)


def hint_of(text: str) -> str:
    """A fragment of an ACL name from any text."""
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")[:32] or "x"
