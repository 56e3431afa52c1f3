"""Writing manifests as YAML, fast.

PyYAML's representer walks every value in Python and costs about 3 µs a value, so a bundle of a
thousand InferenceServices (27 MB of Deployments, Services and PrometheusRules) took seconds to
print.  Manifests are JSON-shaped (mappings with string keys, lists, strings, numbers, booleans,
null), and for those block YAML is simple to write directly: a string is written plain when the
YAML 1.1 resolver would read it back as that same string, and as a double-quoted JSON string
(a valid YAML double-quoted scalar) otherwise.  Anything else falls back to PyYAML.
A property test holds `yaml.safe_load(dump(x)) == x`.
"""

from __future__ import annotations

import functools
import json
import math
import re
from typing import Any

import yaml

# A plain scalar must not start with an indicator or a space, contain `: ` or ` #`, end with `:` or
# a space, or hold a character outside YAML's printable set (or one YAML reads as a line break);
# the resolver check below then rules out `true`, `null`, `1.5`, `2001-12-14` and the like.
_PLAIN_FIRST_UNSAFE = frozenset("-?:,[]{}#&*!|>'\"%@` \t")
_PLAIN_UNSAFE = re.compile("[^\x20-\x7e\xa0-\u2027\u202a-\ud7ff\ue000-\ufefe\uff00-\ufffd\U00010000-\U0010ffff]")
# An implicit key may not be longer than this (YAML's simple-key limit is 1024 characters).
_MAX_KEY = 1000
_RESOLVER = yaml.resolver.Resolver()
_YAML_UNSAFE = re.compile("[\x7f-\x9f\u2028\u2029\ud800-\udfff\ufffe\uffff]")


class _Unsupported(Exception):
    pass


@functools.lru_cache(maxsize=65536)
def _string(value: str) -> str:
    if (value and value[0] not in _PLAIN_FIRST_UNSAFE and value[-1] not in " :"
            and ": " not in value and " #" not in value and _PLAIN_UNSAFE.search(value) is None
            and _RESOLVER.resolve(yaml.ScalarNode, value, (True, False)) == "tag:yaml.org,2002:str"):
        return value
    # JSON's escapes are YAML's; what YAML would read as a line break (U+0085, U+2028...) or refuse
    # as non-printable is escaped too.
    return _YAML_UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", json.dumps(value, ensure_ascii=False))


# What a literal block (`|`) may hold: printable text whose first line does not start with a space
# (the block's indentation is read from it), without carriage returns or YAML's other line breaks.
_BLOCK_UNSAFE = re.compile("[^\t\n\x20-\x7e\xa0-\u2027\u202a-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _block(value: str, indent: str) -> str | None:
    """`value` as a literal block scalar (multi-line PromQL reads best so), or None if it cannot be one."""
    if "\n" not in value or value[:1] in (" ", "\t", "\n") or _BLOCK_UNSAFE.search(value):
        return None
    body = value.rstrip("\n")
    trailing = len(value) - len(body)
    chomp = "-" if trailing == 0 else "" if trailing == 1 else "+"
    lines = body.split("\n") + [""] * (trailing - 1 if trailing > 1 else 0)
    pad = indent + "  "
    return f"|{chomp}\n" + "".join(f"{pad}{line}\n" if line else "\n" for line in lines)


def _scalar(value: Any) -> str:
    if isinstance(value, str):
        return _string(value)
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return ".nan"
        if math.isinf(value):
            return ".inf" if value > 0 else "-.inf"
        text = repr(value)
        if "." not in text and "e" in text:  # YAML 1.1 floats need a dot: 1e+20 -> 1.0e+20
            mantissa, _, exponent = text.partition("e")
            text = f"{mantissa}.0e{exponent}"
        return text
    raise _Unsupported(type(value).__name__)


def _emit(value: Any, indent: str, out: list[str], blocks: bool = False) -> None:
    """Append the block lines of a mapping or a non-empty list (each ends with a newline).
    With `blocks`, multi-line strings in mappings are written as literal blocks."""
    if isinstance(value, dict):
        for key, item in value.items():
            if type(key) is not str or len(key) > _MAX_KEY:
                raise _Unsupported("a key PyYAML must write")
            head = f"{indent}{_string(key)}:"
            kind = type(item)
            if kind is str and not (blocks and "\n" in item):  # the common case, first
                out.append(f"{head} {_string(item)}\n")
            elif kind is int:
                out.append(f"{head} {item}\n")
            elif isinstance(item, dict) and item:
                out.append(head + "\n")
                _emit(item, indent + "  ", out, blocks)
            elif isinstance(item, list) and item:
                out.append(head + "\n")
                _emit(item, indent, out, blocks)
            elif blocks and isinstance(item, str) and (block := _block(item, indent)) is not None:
                out.append(f"{head} {block}")
            else:
                out.append(f"{head} {_inline(item)}\n")
        return
    for item in value:
        if isinstance(item, dict) and item:
            sub: list[str] = []
            _emit(item, indent + "  ", sub, blocks)
            first = sub[0]
            out.append(f"{indent}- {first[len(indent) + 2:]}")
            out.extend(sub[1:])
        elif isinstance(item, list) and item:
            sub = []
            _emit(item, indent + "  ", sub, blocks)
            out.append(f"{indent}- {sub[0][len(indent) + 2:]}")
            out.extend(sub[1:])
        else:
            out.append(f"{indent}- {_inline(item)}\n")


def _inline(value: Any) -> str:
    if isinstance(value, dict):
        return "{}"
    if isinstance(value, list):
        return "[]"
    return _scalar(value)


def dump(document: Any, *, blocks: bool = False) -> str:
    """One document as YAML (no `---`)."""
    return dump_all([document], blocks=blocks)


def dump_all(documents: list[Any], *, blocks: bool = False) -> str:
    """Documents as a multi-document YAML stream (`---` between them), as yaml.safe_dump_all would
    give them in meaning.  With `blocks`, multi-line strings are literal blocks."""
    try:
        parts: list[str] = []
        for i, doc in enumerate(documents):
            if i:
                parts.append("---\n")
            if isinstance(doc, dict | list) and doc:
                _emit(doc, "", parts, blocks)
            else:
                parts.append(_inline(doc) + "\n")
        return "".join(parts)
    except _Unsupported:
        dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
        return yaml.dump_all(documents, Dumper=dumper, sort_keys=False, default_flow_style=False)
