"""Whatever JSON a client sends, the parser answers with a request or an OpenAIError, never
another exception (which the server would have to turn into a 500)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.twin.server import protocol as proto

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
FIELDS = ("model", "prompt", "messages", "max_tokens", "max_completion_tokens", "min_tokens", "stream",
          "stream_options", "ignore_eos", "temperature", "top_p", "n", "best_of", "presence_penalty")
message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]) | json_values},
                                optional={"content": st.text(max_size=30) | json_values
                                          | st.lists(st.fixed_dictionaries(
                                              {"type": st.sampled_from(["text", "image_url"]) | json_values},
                                              optional={"text": st.text(max_size=20) | json_values}),
                                              max_size=3)})
bodies = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=8) | st.fixed_dictionaries(
    {}, optional={"prompt": st.text(max_size=50) | st.lists(st.integers(-5, 50), max_size=6),
                  "messages": st.lists(message, max_size=3),
                  "max_tokens": st.integers(-3, 5000) | json_values,
                  "stream": st.booleans(), "stream_options": st.fixed_dictionaries(
                      {}, optional={"include_usage": st.booleans() | json_values}),
                  "model": st.sampled_from(["m", "other"])})


@settings(max_examples=150, deadline=None, derandomize=True)
@given(body=bodies, kind=st.sampled_from(["completion", "chat"]))
def test_parser_never_raises_anything_but_openai_errors(body, kind):
    try:
        req = proto.parse_generation_request(body, kind, served_model_name="m", max_model_len=512)
    except proto.OpenAIError as exc:
        assert exc.status in (400, 404) and exc.message
        return
    assert req.prompt_tokens >= 1 and req.max_tokens >= 1 and req.prompt_tokens + req.max_tokens <= 512
    budget, _ = req.output_budget()
    assert 1 <= budget <= req.max_tokens


@settings(max_examples=100, deadline=None, derandomize=True)
@given(raw=st.binary(max_size=64) | st.text(max_size=64).map(str.encode))
def test_body_decoding_never_raises_anything_but_openai_errors(raw):
    try:
        body = proto.decode_json_object(raw)
    except proto.OpenAIError as exc:
        assert exc.status == 400
        return
    assert isinstance(body, dict)
