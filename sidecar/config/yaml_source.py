"""Safe YAML reading that keeps line numbers and refuses what PyYAML would hide.

PyYAML silently keeps the last of two duplicate mapping keys and forgets where
things came from. Config errors must name the file and place at fault, so mappings
are built as :class:`MarkedMapping`, which remembers the line of each key.
"""

from __future__ import annotations

from typing import Any

import yaml

MAX_FILE_BYTES = 8 * 1024 * 1024
"""A descriptor config far larger than this is a mistake, not a config."""

MAX_NODES = 200_000
"""Bound on YAML nodes built, so alias bombs cannot expand without limit."""


class YamlError(Exception):
    """The text is not YAML we accept; ``line`` is 1-based, 0 when unknown."""

    def __init__(self, message: str, line: int = 0) -> None:
        super().__init__(message)
        self.line = line


class MarkedMapping(dict[Any, Any]):
    """A dict that knows the line it starts on and the line of each key."""

    line: int
    key_lines: dict[Any, int]
    scalar_texts: dict[Any, str]
    """Source text of each plain scalar value, so ``010`` or ``12:30`` can be read as written."""

    def line_of(self, key: Any) -> int:
        """Line of ``key`` if present, else of the mapping itself."""
        return self.key_lines.get(key, self.line)


class _MarkedLoader(yaml.SafeLoader):
    """SafeLoader building :class:`MarkedMapping` and counting constructed nodes."""

    nodes_built = 0

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        self.nodes_built += 1
        if self.nodes_built > MAX_NODES:
            raise YamlError(f"more than {MAX_NODES} YAML nodes (alias expansion?)", node.start_mark.line + 1)
        return super().construct_object(node, deep=deep)


def _construct_mapping(loader: _MarkedLoader, node: yaml.MappingNode) -> MarkedMapping:
    loader.flatten_mapping(node)
    mapping = MarkedMapping()
    mapping.line = node.start_mark.line + 1
    mapping.key_lines = {}
    mapping.scalar_texts = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        try:
            hash(key)
        except TypeError:
            raise YamlError("a mapping key must be a plain value", line) from None
        if key in mapping.key_lines:
            raise YamlError(f"duplicate key {key!r} (first on line {mapping.key_lines[key]})", line)
        mapping[key] = loader.construct_object(value_node, deep=True)
        mapping.key_lines[key] = line
        if isinstance(value_node, yaml.ScalarNode):
            mapping.scalar_texts[key] = value_node.value
    return mapping


_MarkedLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
    _construct_mapping,
)


def load_yaml(text: str) -> Any:
    """Parse one YAML document; raises :class:`YamlError` with a line number."""
    if len(text.encode("utf-8", "surrogatepass")) > MAX_FILE_BYTES:
        raise YamlError(f"file is larger than {MAX_FILE_BYTES // (1024 * 1024)} MiB")
    try:
        # The reader refuses non-printable characters while the loader is built,
        # with a ReaderError that has a position but no mark and a two-line message.
        loader = _MarkedLoader(text)
    except yaml.reader.ReaderError as error:
        line = text.count("\n", 0, error.position) + 1
        raise YamlError(f"invalid YAML: unacceptable character #x{error.character:04x}: {error.reason}", line) from None
    try:
        document = loader.get_single_node()
        return None if document is None else loader.construct_document(document)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        line = mark.line + 1 if mark else 0
        raise YamlError(f"invalid YAML: {error.problem or error}", line) from None
    except yaml.YAMLError as error:
        raise YamlError(f"invalid YAML: {error}") from None
    except RecursionError:
        raise YamlError("YAML nested too deeply") from None
    finally:
        loader.dispose()
