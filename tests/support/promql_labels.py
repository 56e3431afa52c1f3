"""The label matchers of PromQL queries, read with a real parser, matched against the series scraped.

    selectors('sum(rate(vllm:x{namespace="a"}[5m]))')   # -> [Selected("vllm:x", (("namespace", "=", "a"),))]
    problems(scraped, [(query, {"pod"})], checked=lambda name: name.startswith("vllm:"))

`scraped` maps a sample name (`vllm:x_bucket`, `up`) to the label sets of its series as Prometheus
stores them; each read is a query and the labels something else reads off its result (a Grafana
legend's `{{pod}}`, a `label_values` variable).  A selector passes when at least one series
satisfies all its matchers, as Prometheus matches them (a missing label is the empty string;
regular expressions are anchored).  promql-parser is the Rust PromQL parser GreptimeDB uses.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

promql_parser = pytest.importorskip("promql_parser", reason="promql-parser (a test dependency) is not installed")

_OPS = {"MatchOp.Equal": "=", "MatchOp.NotEqual": "!=", "MatchOp.Re": "=~", "MatchOp.NotRe": "!~"}


@dataclass(frozen=True)
class Selected:
    name: str
    matchers: tuple[tuple[str, str, str], ...]  # (label, op, value)

    @property
    def labels(self) -> set[str]:
        return {label for label, _, _ in self.matchers}

    def matches(self, series: Mapping[str, str]) -> bool:
        for label, op, value in self.matchers:
            have = series.get(label, "")
            ok = {"=": have == value, "!=": have != value,
                  "=~": re.fullmatch(value, have) is not None, "!~": re.fullmatch(value, have) is None}[op]
            if not ok:
                return False
        return True


def selectors(expr: str) -> list[Selected]:
    """Every vector selector in a PromQL expression, with its label matchers."""
    found: list[Selected] = []

    def visit(node: Any) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            ms = list(node.matchers.matchers) + [m for group in node.matchers.or_matchers for m in group]
            found.append(Selected(node.name or "", tuple((m.name, _OPS[str(m.op)], m.value) for m in ms
                                                         if m.name != "__name__")))
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    return found


def problems(scraped: Mapping[str, Sequence[Mapping[str, str]]], reads: Iterable[tuple[str, set[str]]], *,
             checked: Callable[[str], bool], rename: Callable[[str], str] = lambda name: name) -> list[str]:
    """The selectors (of series `checked` says are in scope) that no scraped series satisfies, and
    the labels read off a query's result that its series lack.  `rename` maps a name to the one
    whose series stand for it (a metric renamed upstream, queried as a fallback)."""
    out = []
    for expr, reads_off in reads:
        scoped = [s for s in selectors(expr) if checked(s.name)]
        for sel in scoped:
            series = scraped.get(rename(sel.name))
            if not series:
                out.append(f"{sel.name}: no such series is scraped ({expr})")
            elif not any(sel.matches(s) for s in series):
                lacking = sorted(sel.labels - {k for s in series for k in s})
                out.append(f"{sel.name}: no series matches {list(sel.matchers)}"
                           + (f"; its series lack {lacking}" if lacking else "") + f": {expr}")
        for label in reads_off:
            if scoped and not any(label in s for sel in scoped for s in scraped.get(rename(sel.name), ())):
                out.append(f"reads label {label!r}, which the series lack: {expr}")
    return out


def count_checked(reads: Iterable[tuple[str, set[str]]], checked: Callable[[str], bool]) -> int:
    return sum(1 for expr, _ in reads for sel in selectors(expr) if checked(sel.name))
