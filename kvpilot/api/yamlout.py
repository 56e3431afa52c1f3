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

# Plain scalars that cannot be read as anything but a string, nor as YAML syntax: no leading
# indicator, no `: ` or ` #`, no trailing `:`, no leading/trailing space.  The resolver check below rules out
# `true`, `null`, `1.5`, `2001-12-14` and the like.
_PLAIN = re.compile(r"^[A-Za-z_/.$][A-Za-z0-9_./$()\-:]*( [A-Za-z0-9_./$()\-:]+)*$")
_RESOLVER = yaml.resolver.Resolver()
_YAML_UNSAFE = re.compile("[\x7f-\x9f\u2028\u2029\ud800-\udfff\ufffe\uffff]")


class _Unsupported(Exception):
    pass


@functools.lru_cache(maxsize=65536)
def _string(value: str) -> str:
    if (_PLAIN.match(value) and ": " not in value and not value.endswith(":")
            and _RESOLVER.resolve(yaml.ScalarNode, value, (True, False)) == "tag:yaml.org,2002:str"):
        return value
    # JSON's escapes are YAML's; what YAML would read as a line break (U+0085, U+2028...) or refuse
    # as non-printable is escaped too.
    return _YAML_UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", json.dumps(value, ensure_ascii=False))


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


def _emit(value: Any, indent: str, out: list[str]) -> None:
    """Append the block lines of a mapping or a non-empty list (each ends with a newline)."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise _Unsupported("non-string key")
            head = f"{indent}{_string(key)}:"
            if isinstance(item, dict) and item:
                out.append(head + "\n")
                _emit(item, indent + "  ", out)
            elif isinstance(item, list) and item:
                out.append(head + "\n")
                _emit(item, indent, out)
            else:
                out.append(f"{head} {_inline(item)}\n")
        return
    for item in value:
        if isinstance(item, dict) and item:
            sub: list[str] = []
            _emit(item, indent + "  ", sub)
            first = sub[0]
            out.append(f"{indent}- {first[len(indent) + 2:]}")
            out.extend(sub[1:])
        elif isinstance(item, list) and item:
            sub = []
            _emit(item, indent + "  ", sub)
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


def dump_all(documents: list[Any]) -> str:
    """Documents as a multi-document YAML stream (`---` between them), as yaml.safe_dump_all would
    give them in meaning."""
    try:
        parts: list[str] = []
        for i, doc in enumerate(documents):
            if i:
                parts.append("---\n")
            if isinstance(doc, dict | list) and doc:
                _emit(doc, "", parts)
            else:
                parts.append(_inline(doc) + "\n")
        return "".join(parts)
    except _Unsupported:
        dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
        return yaml.dump_all(documents, Dumper=dumper, sort_keys=False, default_flow_style=False)
