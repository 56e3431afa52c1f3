"""PromQL builders: quoting, selectors, windows, bucket edges, the pre-0.11 fallbacks."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpilot.api import vllm
from kvpilot.slo import promql
from kvpilot.slo.promql import Matcher, Selector

HOSTILE = [
    'a"b',
    "back\\slash",
    "new\nline",
    'x"} or vector(1) or {y="',
    "}{",
    "{{ .Labels }}",
    "tab\tcr\rnul\x00del\x7f",
    "\\",
    '\\"',
    "ünïcode ✓",
    "line\u2028sep",
]

# A PromQL double-quoted string: escapes, or anything but a quote, backslash or raw control char.
_PROMQL_STRING = re.compile(r'"(?:\\(?:[abfnrtv\\"]|u[0-9a-fA-F]{4})|[^"\\\x00-\x1f\x7f])*"')


@pytest.mark.parametrize("value", HOSTILE)
def test_quote_is_one_promql_string_holding_exactly_the_value(value: str) -> None:
    text = promql.quote(value)
    assert _PROMQL_STRING.fullmatch(text), text
    assert "\n" not in text and "\r" not in text
    # Our escapes are Go's and a subset of JSON's: decoding gives the value back.
    assert json.loads(text) == value


@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",))))
def test_quote_round_trips_any_text(value: str) -> None:
    text = promql.quote(value)
    assert _PROMQL_STRING.fullmatch(text)
    assert json.loads(text) == value


def test_quote_refuses_lone_surrogates() -> None:
    with pytest.raises(ValueError, match="not valid Unicode"):
        promql.quote("a\ud800")


@pytest.mark.parametrize("value", HOSTILE)
def test_hostile_values_cannot_add_matchers_or_close_the_selector(value: str) -> None:
    sel = Selector.for_inferenceservice(value, value)
    rendered = str(sel)
    # Strip the two string literals: what is left is exactly the selector's skeleton.
    skeleton = _PROMQL_STRING.sub("S", rendered)
    assert skeleton == "{namespace=S,kvpilot_dev_inferenceservice=S}"
    expr = promql.quantile("ttft", 0.99, sel)
    assert _PROMQL_STRING.sub("S", expr) == (
        "histogram_quantile(0.99, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket"
        "{namespace=S,kvpilot_dev_inferenceservice=S}[5m])))"
    )


def test_selectors_for_local_processes() -> None:
    assert str(Selector.for_job("twin")) == '{job="twin"}'
    assert str(Selector.for_model("m", namespace="ns")) == '{namespace="ns",model_name="m"}'
    assert str(Selector.of({"a": "1"}, b="2")) == '{a="1",b="2"}'


@pytest.mark.parametrize("name", ["", "1abc", "kvpilot.dev/inferenceservice", 'a"', "a b"])
def test_label_names_are_checked(name: str) -> None:
    with pytest.raises(ValueError, match="not a Prometheus label name"):
        Matcher(name, "v")


def test_bad_matcher_operator_and_empty_selector() -> None:
    with pytest.raises(ValueError, match="operator"):
        Matcher("a", "b", "==")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one"):
        Selector(())


@pytest.mark.parametrize("window,seconds", [("5m", 300), ("600s", 600), ("1h30m", 5400), ("3d", 259200), ("250ms", 0.25)])
def test_durations(window: str, seconds: float) -> None:
    assert promql.duration_seconds(window) == seconds


@pytest.mark.parametrize("window", ["", "5", "5 m", "m5", "5m]", "5m) or vector(1", "-5m", "5M"])
def test_bad_windows_are_refused_with_the_allowed_form(window: str) -> None:
    with pytest.raises(ValueError, match="not a Prometheus duration"):
        promql.quantile("ttft", 0.99, Selector.for_job("j"), window)


def test_bucket_edges_are_enforced() -> None:
    sel = Selector.for_job("j")
    for edge in vllm.TTFT_BUCKETS:
        promql.error_ratio("ttft", edge, sel)
    with pytest.raises(ValueError, match=r"0\.3s is not a bucket edge of vllm:time_to_first_token_seconds; allowed: 0\.001"):
        promql.error_ratio("ttft", 0.3, sel)
    with pytest.raises(ValueError, match="inter_token_latency"):
        promql.error_ratio("itl", 0.06, sel)


def test_le_matches_both_spellings_of_whole_edges() -> None:
    assert promql.le_matcher(0.5).render() == 'le="0.5"'
    whole = promql.le_matcher(1.0)
    assert whole.op == "=~"
    pattern = json.loads(promql.quote(whole.value))
    assert re.fullmatch(pattern, "1") and re.fullmatch(pattern, "1.0")
    assert not re.fullmatch(pattern, "10") and not re.fullmatch(pattern, "1x0")


def test_itl_and_kv_fall_back_to_pre_0_11_names() -> None:
    sel = Selector.for_job("j")
    itl = promql.quantile("itl", 0.99, sel)
    assert itl.index(vllm.METRIC_ITL) < itl.index(" or ") < itl.index(vllm.METRIC_ITL_LEGACY)
    kv = promql.kv_cache_usage(sel)
    assert vllm.METRIC_KV_USAGE in kv and vllm.METRIC_KV_USAGE_LEGACY in kv and " or " in kv
    # TTFT never changed its name: no fallback, no `or`.
    assert " or " not in promql.quantile("ttft", 0.99, sel)


def test_error_ratio_and_burn_rate_shape() -> None:
    sel = Selector.for_job("j")
    ratio = promql.error_ratio("ttft", 0.5, sel, "1h")
    assert ratio.startswith("1 - (") and 'le="0.5"' in ratio and "[1h]" in ratio
    assert "_count{" in ratio
    burn = promql.burn_rate("ttft", 0.5, 0.999, sel, "5m")
    assert burn.endswith(") / 0.001")
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        promql.burn_rate("ttft", 0.5, 1.0, sel)


def test_numbers_print_shortest() -> None:
    assert [promql.num(x) for x in (14.4, 6.0, 0.01, 1e-05, 0.5)] == ["14.4", "6", "0.01", "1e-05", "0.5"]


def test_grafana_ranges_pass_through() -> None:
    assert "[$__rate_interval]" in promql.request_rate(Selector.for_job("j"), "$__rate_interval")
