"""YAML text for generated rules: readable multi-line expressions, exact strings.

Written by kvpilot's block writer (kvpilot.api.yamlout): multi-line PromQL as literal blocks,
everything else plain where YAML reads it back as the same string, double-quoted otherwise.
PyYAML's representer took seconds for the rules of a thousand services.
"""

from __future__ import annotations

from typing import Any

from kvpilot.api import yamlout


def dump(obj: Any) -> str:
    return yamlout.dump(obj, blocks=True)


def dump_all(objs: list[Any]) -> str:
    return yamlout.dump_all(objs, blocks=True)
