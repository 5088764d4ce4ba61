"""Safe YAML reading that keeps line numbers and refuses what PyYAML would hide.

PyYAML silently keeps the last of two duplicate mapping keys and forgets where
things came from. Config errors must name the file and place at fault, so mappings
are built as :class:`MarkedMapping`, which remembers the line of each key.
"""

from __future__ import annotations

from typing import Any

import yaml

MAX_FILE_BYTES = 8 * 1024 * 1024
"""A descriptor config far larger than this is a mistake, not a config: the default of
``--max-config-bytes``, checked before a file is read (:func:`~sidecar.config.load.load_config`)."""

MAX_NODES = 200_000
"""Bound on YAML nodes, counted with every alias and merge key expanded, so alias
bombs cannot expand without limit: neither in PyYAML's merge-key flattening nor in
the config parser, which walks an aliased subtree once per reference."""


def too_large(size: int, max_bytes: int) -> str:
    """The issue of a file over the cap: its size and the cap, and the flag that sets it."""
    return f"file is {size:,} bytes, over the {max_bytes:,}-byte cap (--max-config-bytes)"


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
    """SafeLoader building :class:`MarkedMapping` and counting composed and constructed nodes."""

    nodes_built = 0
    nodes_composed = 0

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        # Counted while composing too: an 8 MiB flow list ``[1,1,1,...]`` is four million
        # nodes, gigabytes of node objects and a minute of CPU before construction starts.
        self.nodes_composed += 1
        if self.nodes_composed > MAX_NODES:
            raise YamlError(f"more than {MAX_NODES} YAML nodes", self.get_mark().line + 1)
        return super().compose_node(parent, index)

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


def expanded_size(root: yaml.Node) -> int:
    """Nodes of the document with every alias expanded; :class:`YamlError` past :data:`MAX_NODES`.

    Memoized per node, so it costs one pass over the composed nodes however many
    times they are aliased. It runs before construction because PyYAML flattens
    merge keys (``<<: [*a, *a]``) by copying, before any node is counted: nested
    merges double at every level. A node that contains itself is refused too.
    """
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node: yaml.Node) -> int:
        known = sizes.get(id(node))
        if known is not None:
            return known
        if id(node) in open_nodes:
            raise YamlError("recursive alias: a node contains itself", node.start_mark.line + 1)
        open_nodes.add(id(node))
        total = 1
        if isinstance(node, yaml.SequenceNode):
            total += sum(size(child) for child in node.value)
        elif isinstance(node, yaml.MappingNode):
            total += sum(size(key) + size(value) for key, value in node.value)
        open_nodes.discard(id(node))
        if total > MAX_NODES:
            raise YamlError(f"more than {MAX_NODES} YAML nodes once aliases are expanded", node.start_mark.line + 1)
        sizes[id(node)] = total
        return total

    return size(root)


def load_yaml(text: str, max_bytes: int = MAX_FILE_BYTES) -> Any:
    """Parse one YAML document of at most ``max_bytes`` (UTF-8); raises :class:`YamlError` with a line number."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise YamlError(too_large(size, max_bytes))
    try:
        # The reader refuses non-printable characters while the loader is built,
        # with a ReaderError that has a position but no mark and a two-line message.
        loader = _MarkedLoader(text)
    except yaml.reader.ReaderError as error:
        line = text.count("\n", 0, error.position) + 1
        raise YamlError(f"invalid YAML: unacceptable character #x{error.character:04x}: {error.reason}", line) from None
    try:
        document = loader.get_single_node()
        if document is None:
            return None
        expanded_size(document)
        return loader.construct_document(document)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        line = mark.line + 1 if mark else 0
        raise YamlError(f"invalid YAML: {error.problem or error}", line) from None
    except yaml.YAMLError as error:
        raise YamlError(f"invalid YAML: {error}") from None
    except RecursionError:
        raise YamlError("YAML nested too deeply", loader.get_mark().line + 1) from None
    finally:
        loader.dispose()
