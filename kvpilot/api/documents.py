"""Reading YAML manifests with bounded time and memory, whatever the input.

A manifest comes from a user, a script or an attacker, so reading one is bounded before any of it
is believed:

* size: at most `MAX_BYTES` (the Kubernetes API server's own limit on a request body);
* encoding: UTF-8 (a byte-order mark is allowed); a bad byte is named with its line and column;
* shape: every document is first walked as a stream of parser events, which costs time linear in
  the text, and refused when it nests deeper than `MAX_DEPTH` or holds more than `MAX_NODES`
  values once aliases are expanded (a "billion laughs" document expands exponentially), or when an
  alias refers to a collection it sits inside (an infinite document).  Only then is it built.
* the stream as a whole: at most `MAX_DOCUMENTS` documents (empty ones too: each costs a parse)
  and `MAX_STREAM_NODES` values across them, so that what every command does per document (build,
  validate, render) is bounded for the stream, not only for each document of it.
* duplicate keys are refused, as `kubectl` does (the YAML spec forbids them; PyYAML would silently
  keep the last one).

libyaml (PyYAML's C loader) parses when it is available: the pure-Python one is ten times slower.
Every problem is a `DocumentError` whose message says where (line, column) and what is wrong.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from typing import IO, Any

import yaml
from yaml import events

# kube-apiserver refuses request bodies over 3 MiB (its MaxRequestBodyBytes).
MAX_BYTES = 3 * 1024 * 1024
# An InferenceService nests about six levels; anything near this is not a manifest.
MAX_DEPTH = 64
# Values (scalars and collections) in one document with aliases expanded; an InferenceService
# holds about a hundred.
MAX_NODES = 100_000
# A stream (one -f input): a bundle of a thousand InferenceServices holds about 100,000 values.  Each
# value costs a few microseconds to walk and build, so these keep the whole stream within a couple of
# CPU-seconds, where 3 MiB of `{}\n---\n` (449,000 documents) took 7.
MAX_DOCUMENTS = 1000
MAX_STREAM_NODES = 200_000

_BaseLoader: Any
_BaseParser: Any
try:  # libyaml
    from yaml.cyaml import CParser as _BaseParser  # type: ignore[attr-defined]
    from yaml.cyaml import CSafeLoader as _BaseLoader
except ImportError:  # pragma: no cover - PyYAML built without libyaml
    _BaseLoader, _BaseParser = yaml.SafeLoader, None

LIBYAML = _BaseParser is not None


class DocumentError(ValueError):
    """A manifest that cannot be read; `str()` is one line saying where and what."""

    def __init__(self, message: str, *, document: int | None = None) -> None:
        super().__init__(message)
        self.document = document  # 0-based index of the document it concerns, when known


def brief(value: Any, limit: int = 60) -> str:
    """A short description of any value for an error message.

    Never `repr()` of the whole value: a collection may be huge (or, through aliases, share
    its parts exponentially), so only scalars are shown, and only their first characters.
    """
    if isinstance(value, str):
        text = repr(value[: limit + 1])
        return text if len(value) <= limit else text[: limit - 3] + "...'"
    if value is None or isinstance(value, bool | float):
        return repr(value)
    if isinstance(value, int):
        if value.bit_length() > 200:  # str() of a huge int is slow, and capped by Python itself
            return f"an integer of about {int(value.bit_length() * 0.30103)} digits"
        text = str(value)
        return text if len(text) <= limit else text[: limit - 3] + "..."
    if isinstance(value, dict):
        return f"a mapping of {len(value)} key{'s' if len(value) != 1 else ''}"
    if isinstance(value, list | tuple):
        return f"a list of {len(value)} item{'s' if len(value) != 1 else ''}"
    return f"a value of type {type(value).__name__}"


def _where(mark: Any) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "an unknown position"


def decode(data: bytes | str) -> str:
    """The text of a manifest: UTF-8 (with or without a byte-order mark), at most MAX_BYTES."""
    if isinstance(data, str):
        # Python text may hold lone surrogates (from surrogateescape); they are not characters.
        try:
            raw = data.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise DocumentError(
                f"not valid Unicode: a lone surrogate at character {exc.start + 1}; save the file as UTF-8"
            ) from None
        if len(raw) > MAX_BYTES:
            raise DocumentError(_too_big(len(raw)))
        return data.removeprefix("\ufeff")
    if len(data) > MAX_BYTES:
        raise DocumentError(_too_big(len(data)))
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        byte = data[exc.start]
        raise DocumentError(
            f"not UTF-8: byte 0x{byte:02x} at line {line}, column {column} (byte offset {exc.start}) "
            "is not valid UTF-8; save the file as UTF-8"
        ) from None


def _too_big(size: int) -> str:
    return (
        f"the input is larger than {MAX_BYTES // (1024 * 1024)} MiB ({size} bytes or more); "
        "the Kubernetes API server refuses bodies that large"
    )


# The files kubectl reads from a directory given to -f (others there are skipped).
MANIFEST_SUFFIXES = (".json", ".yaml", ".yml")


def expand_filenames(names: Sequence[str], recursive: bool = False) -> list[str]:
    """-f arguments as kubectl reads them: a directory stands for its .json, .yaml and .yml files in
    name order (its subdirectories' too with `recursive`); files and `-` stay as given."""
    out: list[str] = []
    for name in names:
        if name == "-" or not os.path.isdir(name):
            out.append(name)
            continue
        found: list[str] = []
        for root, dirs, files in os.walk(name):
            dirs[:] = sorted(dirs) if recursive else []
            found.extend(os.path.join(root, f) for f in sorted(files) if f.endswith(MANIFEST_SUFFIXES))
        if not found:
            raise DocumentError(f"{name}: a directory with no {', '.join(MANIFEST_SUFFIXES)} files"
                                + ("" if recursive else " (-R reads its subdirectories too)"))
        out.extend(found)
    return out


def read_source(name: str, stdin: IO[bytes] | None = None) -> bytes:
    """The bytes of a file, or of stdin for `-`, reading no more than MAX_BYTES + 1.

    OSError for a file that cannot be opened; DocumentError when it is too large."""
    if name == "-":
        stream = stdin if stdin is not None else sys.stdin.buffer
        data = stream.read(MAX_BYTES + 1)
    else:
        with open(name, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        raise DocumentError(_too_big(len(data)))
    return data


def _check_shape(text: str) -> None:
    """Walk the parser events once, in linear time, and refuse what would be costly to build."""
    parser = _BaseParser(text) if _BaseParser is not None else yaml.SafeLoader(text)
    document = -1
    stream_values = 0  # with aliases expanded, across every document so far
    # One entry per open collection: [expanded values so far, its anchor].
    stack: list[list[Any]] = []
    anchors: dict[str, int] = {}
    open_anchors: set[str] = set()
    try:
        while parser.check_event():
            event = parser.get_event()
            kind = type(event)
            size = 0
            if kind is events.ScalarEvent:
                size = 1
                if event.anchor is not None:
                    anchors[event.anchor] = 1
            elif kind is events.MappingStartEvent or kind is events.SequenceStartEvent:
                if len(stack) >= MAX_DEPTH:
                    raise DocumentError(
                        f"at {_where(event.start_mark)}: nested more than "
                        f"{MAX_DEPTH} levels deep (an InferenceService nests about 6)",
                        document=document,
                    )
                stack.append([1, event.anchor])
                if event.anchor is not None:
                    open_anchors.add(event.anchor)
                stream_values += 1
                _check_stream(stream_values, event, document)
                continue
            elif kind is events.MappingEndEvent or kind is events.SequenceEndEvent:
                size, anchor = stack.pop()
                if anchor is not None:
                    anchors[anchor] = size
                    open_anchors.discard(anchor)
            elif kind is events.AliasEvent:
                name = event.anchor
                if name in open_anchors:
                    raise DocumentError(
                        f"at {_where(event.start_mark)}: alias *{brief(name)[1:-1]} "
                        "refers to a collection that contains it, which would make the document infinite",
                        document=document,
                    )
                if name not in anchors:
                    raise DocumentError(
                        f"not valid YAML at {_where(event.start_mark)}: found undefined alias "
                        f"*{brief(name)[1:-1]}",
                        document=document,
                    )
                size = anchors[name]
            elif kind is events.DocumentStartEvent:
                document += 1
                if document >= MAX_DOCUMENTS:
                    raise DocumentError(
                        f"at {_where(event.start_mark)}: the input holds more than "
                        f"{MAX_DOCUMENTS} YAML documents (empty ones count too); split it into several files",
                        document=document,
                    )
                anchors.clear()  # anchors are local to a document
                continue
            else:
                continue
            if stack:
                stack[-1][0] += size
                total = stack[-1][0]
            else:
                total = size
            if kind is not events.MappingEndEvent and kind is not events.SequenceEndEvent:
                stream_values += size  # a collection counted once, where it opened
            if total > MAX_NODES:
                raise DocumentError(
                    f"at {_where(event.start_mark)}: holds more than {MAX_NODES} "
                    "values with its aliases expanded (an InferenceService holds about a hundred); "
                    "aliases may be used, but not to multiply a document",
                    document=document,
                )
            _check_stream(stream_values, event, document)
    except yaml.MarkedYAMLError as exc:
        raise DocumentError(_yaml_message(exc), document=max(document, 0)) from None
    except yaml.YAMLError as exc:
        raise DocumentError(f"not valid YAML: {_first_line(str(exc))}", document=max(document, 0)) from None
    finally:
        dispose = getattr(parser, "dispose", None)
        if dispose is not None:
            dispose()


def _check_stream(values: int, event: Any, document: int) -> None:
    if values > MAX_STREAM_NODES:
        raise DocumentError(
            f"at {_where(event.start_mark)}: the input holds more than {MAX_STREAM_NODES} values across its "
            "documents with aliases expanded (a thousand InferenceServices hold about 100000); split it into "
            "several files",
            document=document,
        )


def _first_line(text: str, limit: int = 200) -> str:
    line = text.strip().splitlines()[0] if text.strip() else "unknown problem"
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _yaml_message(exc: yaml.MarkedYAMLError) -> str:
    mark = exc.problem_mark or exc.context_mark
    problem = exc.problem or exc.context or "unknown problem"
    where = f" at {_where(mark)}" if mark is not None else ""
    return f"not valid YAML{where}: {_first_line(problem)}"


class _Loader(_BaseLoader):
    """libyaml's safe loader, refusing duplicate keys and naming where a value cannot be built."""

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except (ValueError, OverflowError, TypeError) as exc:
            # A timestamp with month 13, an integer beyond Python's digit limit, ...
            raise yaml.constructor.ConstructorError(
                None, None, f"cannot read this value: {_first_line(str(exc))}", node.start_mark
            ) from None

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            seen: dict[tuple[str, str], Any] = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = (key_node.tag, key_node.value)
                first = seen.setdefault(key, key_node.start_mark)
                if first is not key_node.start_mark:
                    raise yaml.constructor.ConstructorError(
                        None, None,
                        f"duplicate key {brief(key_node.value)} (first at {_where(first)})",
                        key_node.start_mark,
                    )
        return super().construct_mapping(node, deep)


def load_documents(data: bytes | str) -> Iterator[Any]:
    """The documents of a YAML stream, skipping empty ones (a trailing `---` is common).

    Raises DocumentError (after yielding the documents before the problem, for a problem found
    while building) with one line saying where and what."""
    text = decode(data)
    _check_shape(text)
    loader = _Loader(text)
    index = 0
    try:
        while True:
            try:
                if not loader.check_data():
                    return
                doc = loader.get_data()
            except yaml.MarkedYAMLError as exc:
                raise DocumentError(_yaml_message(exc), document=index) from None
            except yaml.YAMLError as exc:
                raise DocumentError(f"not valid YAML: {_first_line(str(exc))}", document=index) from None
            index += 1
            if doc is not None:
                yield doc
    finally:
        loader.dispose()
