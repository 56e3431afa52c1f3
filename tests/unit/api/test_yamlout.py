"""The fast manifest writer: what it writes, YAML reads back as the same value."""

from __future__ import annotations

import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.api import yamlout

TRICKY = ["", " ", "true", "yes", "No", "null", "~", "1", "1.5", "0x1f", "1e3", ".inf", "2001-12-14", "a: b",
          "a:", "a #b", "- a", "key: [x]", "'q'", '"q"', "a\nb", "\t", "\u2028", "\x85", "é", "vllm/vllm:v1",
          "$(x)", "a  b", " a", "a ", "<<", "=", "?", "!tag", "&a", "*a", "%x", "@x", "`x", "|", ">", "{}", "[]"]
scalars = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
           | st.text(max_size=20) | st.sampled_from(TRICKY))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=8) | st.sampled_from(TRICKY), inner, max_size=4),
                      max_leaves=25)


@settings(max_examples=400, deadline=None, derandomize=True, database=None)
@given(docs=st.lists(values, min_size=1, max_size=3), blocks=st.booleans())
def test_round_trip(docs, blocks):
    text = yamlout.dump_all(docs, blocks=blocks)
    assert list(yaml.load_all(text, Loader=yaml.SafeLoader)) == docs


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(text=st.text(alphabet=st.sampled_from(list("ab {}\"'#:-|>\n\t\u2028\x85é")), max_size=30))
def test_multiline_strings_round_trip_as_blocks(text):
    doc = {"expr": text, "nested": [{"expr": text}]}
    assert yaml.safe_load(yamlout.dump(doc, blocks=True)) == doc


def test_literal_block_for_multiline_text():
    assert yamlout.dump({"expr": "a\n  b"}, blocks=True) == "expr: |-\n  a\n    b\n"


def test_plain_where_safe_quoted_where_not():
    text = yamlout.dump_all([{"image": "vllm/vllm-openai:v0.33.0", "a": "true", "b": "x: y", "c": [1.0e20, None]}])
    assert text == 'image: vllm/vllm-openai:v0.33.0\na: "true"\nb: "x: y"\nc:\n- 1.0e+20\n- null\n'


def test_nan_and_infinities():
    assert yaml.safe_load(yamlout.dump_all([[float("inf"), float("-inf")]])) == [float("inf"), float("-inf")]
