"""YAML from untrusted bytes, in bounded time and memory, with one clear problem when it fails.

PyYAML's safe loader executes nothing, but it will happily read a 300 MB file, recurse
until Python's stack gives out on deep nesting, expand an alias bomb (a few lines that
stand for billions of nodes once anything walks them), and let a duplicated key
silently win. Here the text is bounded before it is parsed, the event stream is scanned
(PyYAML's parser keeps its own stack, so the scan itself cannot overflow) for depth and
for the node count that aliases expand to, and only then is the document composed and
constructed, with duplicated keys refused.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

MAX_BYTES = 1 << 20  # a workload is a few hundred lines; 1 MiB is thousands of them
MAX_DEPTH = 32  # nested collections (a workload needs ~5; model.args and hf.config a few more)
MAX_NODES = 100_000  # scalars and collections, aliases counted as what they expand to


class YamlProblem(Exception):
    """What is wrong with a YAML text; `line` is 1-based, None for the whole text."""

    def __init__(self, message: str, line: int | None = None):
        super().__init__(message)
        self.message = message
        self.line = line


class ShoalYamlLoader(yaml.SafeLoader):
    """The safe loader, with `1e-3` read as a float (YAML 1.1 makes it a string)."""


ShoalYamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
    list("-+0123456789."),
)


def decode(data: bytes) -> str:
    """Bytes as text: at most MAX_BYTES of UTF-8 (a BOM is allowed), or a YamlProblem."""
    if len(data) > MAX_BYTES:
        raise YamlProblem(f"too large for a workload file (more than {MAX_BYTES // 1024} KiB)")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        problem = f"not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})"
        raise YamlProblem(problem, line) from None


def parse(text: str) -> tuple[Any, yaml.Node | None]:
    """The document a text holds and its node tree (for line numbers), or a YamlProblem."""
    if len(text) > MAX_BYTES:
        raise YamlProblem(f"too large for a workload file (more than {MAX_BYTES // 1024} KiB)")
    try:
        _scan(text)
        loader = ShoalYamlLoader(text)
        try:
            node = loader.get_single_node()
            if node is not None:
                _refuse_duplicate_keys(node)
            data = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except yaml.reader.ReaderError as exc:
        line = text[: exc.position].count("\n") + 1
        raise YamlProblem(f"malformed YAML: character #x{exc.character:04x} is not allowed", line) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        problem = getattr(exc, "problem", None) or str(exc).strip().splitlines()[0]
        raise YamlProblem(f"malformed YAML: {problem}", mark.line + 1 if mark else None) from None
    except (ValueError, TypeError, OverflowError) as exc:  # a tagged scalar that does not convert
        raise YamlProblem(f"malformed YAML: {exc}") from None
    return data, node


def _scan(text: str) -> None:
    """Refuse, from the event stream alone, nesting deeper than MAX_DEPTH and documents
    that expand to more than MAX_NODES nodes (aliases counted as their anchor's subtree)."""
    anchored: dict[str, int] = {}  # anchor -> expanded size of its finished subtree
    open_sizes: list[int] = []  # one running count per open collection
    open_anchors: list[str | None] = []
    total = 0
    for event in yaml.parse(text, Loader=ShoalYamlLoader):
        line = event.start_mark.line + 1 if event.start_mark else None
        if isinstance(event, yaml.CollectionStartEvent):
            if len(open_sizes) >= MAX_DEPTH:
                raise YamlProblem(f"nested more than {MAX_DEPTH} levels deep", line)
            open_sizes.append(1)
            open_anchors.append(event.anchor)
            continue
        if isinstance(event, yaml.CollectionEndEvent):
            size = open_sizes.pop()
            if (anchor := open_anchors.pop()) is not None:
                anchored[anchor] = size
        elif isinstance(event, yaml.ScalarEvent):
            size = 1
            if event.anchor is not None:
                anchored[event.anchor] = 1
        elif isinstance(event, yaml.AliasEvent):
            if event.anchor not in anchored:
                raise YamlProblem(f"alias *{event.anchor} refers to no finished anchor", line)
            size = anchored[event.anchor]
        else:
            continue
        if open_sizes:
            open_sizes[-1] += size
        else:
            total += size
        if total + sum(open_sizes) > MAX_NODES:
            raise YamlProblem(f"expands to more than {MAX_NODES:,} values (aliases counted in full)", line)


def _refuse_duplicate_keys(root: yaml.Node) -> None:
    """A key given twice in one mapping is an error: the later value winning hides typos.
    Merge keys (`<<`) are YAML's way to override on purpose and are left to the loader."""
    seen_nodes: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen_nodes:  # an alias: its node was checked where it was anchored
            continue
        seen_nodes.add(id(node))
        if isinstance(node, yaml.MappingNode):
            first: dict[tuple[str, str], int] = {}
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode) and key.value != "<<":
                    ident = (key.tag, key.value)
                    if ident in first:
                        raise YamlProblem(
                            f"duplicate key '{key.value}' (first given on line {first[ident]})",
                            key.start_mark.line + 1,
                        )
                    first[ident] = key.start_mark.line + 1
                stack += [key, value]
        elif isinstance(node, yaml.SequenceNode):
            stack += node.value
