"""YAML text for generated rules: readable multi-line expressions, exact strings."""

from __future__ import annotations

from typing import Any

import yaml

# libyaml's emitter where PyYAML has it: the pure-Python one takes seconds for a large bundle.
_Base: Any = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


class _Dumper(_Base):
    pass


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    # Multi-line PromQL reads best as a literal block; PyYAML falls back to a quoted
    # scalar by itself where a block cannot hold the text exactly (control characters...).
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def dump(obj: Any) -> str:
    return yaml.dump(obj, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=10_000, default_flow_style=False)


def dump_all(objs: list[Any]) -> str:
    return yaml.dump_all(
        objs, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=10_000, default_flow_style=False
    )
