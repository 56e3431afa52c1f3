"""Request parsing and response bodies of the twin's OpenAI-compatible API (pure functions)."""

from __future__ import annotations

import json
import tracemalloc

import pytest

from kvpilot.twin import text
from kvpilot.twin.server import protocol as proto

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def parse(body: dict, kind: proto.Kind = "completion", max_model_len: int = 1024) -> proto.GenerationRequest:
    return proto.parse_generation_request(body, kind, served_model_name=MODEL, max_model_len=max_model_len)


def test_completion_with_text_prompt():
    req = parse({"model": MODEL, "prompt": "Hello there, world", "max_tokens": 5})
    assert req.kind == "completion"
    assert req.prompt_tokens == text.count_prompt_tokens("Hello there, world") == 5  # BOS + 4 pieces
    assert req.max_tokens == 5 and req.max_tokens_param == 5
    assert not req.stream


def test_completion_with_token_ids_and_batch_of_one():
    assert parse({"prompt": [1, 2, 3, 4]}).prompt_tokens == 4
    assert parse({"prompt": [[5, 6]]}).prompt_tokens == 2
    assert parse({"prompt": ["one two"]}).prompt_tokens == 3


def test_model_defaults_to_served_model_and_max_tokens_to_what_is_left():
    req = parse({"prompt": "a b c"}, max_model_len=100)
    assert req.model == MODEL
    assert req.max_tokens == 100 - req.prompt_tokens and req.max_tokens_param is None


def test_chat_string_and_text_parts_count_the_same():
    as_string = parse({"messages": [{"role": "user", "content": "hi there"}]}, "chat")
    as_parts = parse({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi there"}]}]},
                     "chat")
    assert as_string.prompt_tokens == as_parts.prompt_tokens == text.count_chat_tokens(["hi there"])
    assert as_string.output_seed == as_parts.output_seed


def test_chat_max_completion_tokens_wins_over_max_tokens():
    req = parse({"messages": [{"role": "user", "content": "x"}], "max_tokens": 9,
                 "max_completion_tokens": 3}, "chat")
    assert req.max_tokens == 3


def test_stream_options():
    req = parse({"prompt": "x", "stream": True,
                 "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert req.stream and req.include_usage and req.continuous_usage_stats


def test_output_budget_ignore_eos_takes_max_tokens():
    req = parse({"prompt": "x", "max_tokens": 700, "ignore_eos": True})
    assert req.output_budget() == (700, False)


def test_output_budget_without_ignore_eos_may_stop_early_and_is_deterministic():
    req = parse({"prompt": "a question", "max_tokens": 1000})
    budget, eos = req.output_budget()
    assert eos and 16 <= budget <= 512
    assert parse({"prompt": "a question", "max_tokens": 1000}).output_budget() == (budget, eos)
    small = parse({"prompt": "a question", "max_tokens": 4})
    assert small.output_budget() == (4, False)


BAD_REQUESTS = [
    # (kind, body, status, param, words in the message)
    ("completion", {}, 400, "prompt", "required"),
    ("completion", {"prompt": 42}, 400, "prompt", "string"),
    ("completion", {"prompt": []}, 400, "prompt", "empty"),
    ("completion", {"prompt": ["a", "b"]}, 400, "prompt", "batch"),
    ("completion", {"prompt": [1, -2]}, 400, "prompt", "token ids"),
    ("completion", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "at least 1"),
    ("completion", {"prompt": "x", "max_tokens": -5}, 400, "max_tokens", "at least 1"),
    ("completion", {"prompt": "x", "max_tokens": "10"}, 400, "max_tokens", "integer"),
    ("completion", {"prompt": "x", "max_tokens": 2.5}, 400, "max_tokens", "integer"),
    ("completion", {"prompt": "x", "max_tokens": True}, 400, "max_tokens", "integer"),
    ("completion", {"prompt": "x", "max_tokens": 2000}, 400, "max_tokens", "maximum context length"),
    ("completion", {"prompt": " ".join(["w"] * 1100)}, 400, "prompt", "maximum context length"),
    ("completion", {"prompt": "x", "model": "other-model"}, 404, "model", "does not exist"),
    ("completion", {"prompt": "x", "model": 7}, 400, "model", "string"),
    ("completion", {"prompt": "x", "stream": "yes"}, 400, "stream", "true or false"),
    ("completion", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options",
     "stream=True"),
    ("completion", {"prompt": "x", "stream": True, "stream_options": []}, 400, "stream_options", "object"),
    ("completion", {"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}}, 400,
     "stream_options.include_usage", "true or false"),
    ("completion", {"prompt": "x", "temperature": -1}, 400, "temperature", "at least"),
    ("completion", {"prompt": "x", "temperature": "hot"}, 400, "temperature", "number"),
    ("completion", {"prompt": "x", "top_p": 0}, 400, "top_p", "in ("),
    ("completion", {"prompt": "x", "n": 2}, 400, "n", "one choice"),
    ("completion", {"prompt": "x", "ignore_eos": "no"}, 400, "ignore_eos", "true or false"),
    ("completion", {"prompt": "x", "max_tokens": 3, "min_tokens": 5}, 400, "min_tokens", "exceed"),
    ("chat", {}, 400, "messages", "required"),
    ("chat", {"messages": []}, 400, "messages", "non-empty"),
    ("chat", {"messages": "hello"}, 400, "messages", "list"),
    ("chat", {"messages": ["hello"]}, 400, "messages[0]", "object"),
    ("chat", {"messages": [{"content": "hi"}]}, 400, "messages[0].role", "role"),
    ("chat", {"messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content", "string"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400,
     "messages[0].content[0]", "text only"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]}, 400,
     "messages[0].content[0].text", "string"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, 400,
     "max_completion_tokens", "at least 1"),
]


@pytest.mark.parametrize(("kind", "body", "status", "param", "words"), BAD_REQUESTS,
                         ids=[f"{k}-{json.dumps(b)[:40]}" for k, b, *_ in BAD_REQUESTS])
def test_malformed_requests_name_the_field(kind, body, status, param, words):
    with pytest.raises(proto.OpenAIError) as info:
        parse(body, kind)
    err = info.value
    assert err.status == status
    assert err.param == param
    assert words in err.message
    body = err.body()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == status
    assert body["error"]["type"] == ("NotFoundError" if status == 404 else "BadRequestError")


@pytest.mark.parametrize("raw", [b"{not json", b"\xff\xfe", b"[1, 2]", b"\"prompt\"", b""])
def test_body_must_be_a_json_object(raw):
    with pytest.raises(proto.OpenAIError) as info:
        proto.decode_json_object(raw)
    assert info.value.status == 400


def test_full_and_stream_bodies_have_openai_shapes():
    comp = parse({"prompt": "x"})
    chat = parse({"messages": [{"role": "user", "content": "x"}]}, "chat")
    full = proto.full_response(comp, "cmpl-1", 1, " the of", 2, "length")
    assert full["object"] == "text_completion" and full["choices"][0]["text"] == " the of"
    assert full["usage"] == {"prompt_tokens": comp.prompt_tokens, "completion_tokens": 2,
                             "total_tokens": comp.prompt_tokens + 2}
    full_chat = proto.full_response(chat, "chatcmpl-1", 1, " a", 1, "stop")
    assert full_chat["object"] == "chat.completion"
    assert full_chat["choices"][0]["message"]["content"] == " a"
    assert full_chat["choices"][0]["finish_reason"] == "stop"
    role = proto.stream_chunk(chat, "c", 1, text=None, finish_reason=None, role=True)
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    piece = proto.stream_chunk(chat, "c", 1, text=" of", finish_reason="length")
    assert piece["object"] == "chat.completion.chunk" and piece["choices"][0]["delta"] == {"content": " of"}
    usage = proto.usage_chunk(chat, "c", 1, 7)
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 7
    assert proto.sse("[DONE]") == b"data: [DONE]\n\n"
    assert json.loads(proto.sse(usage)[6:]) == usage


def test_models_body():
    body = proto.models_body(MODEL, "meta-llama/Llama-3.1-8B-Instruct", 8192, created=5)
    assert body["data"][0]["id"] == MODEL and body["data"][0]["root"] == MODEL
    assert body["data"][0]["max_model_len"] == 8192


def test_chat_system_message_is_a_shared_prefix():
    system = {"role": "system", "content": "You are a helpful assistant who answers briefly."}
    a = parse({"messages": [system, {"role": "user", "content": "first question"}]}, "chat")
    b = parse({"messages": [system, {"role": "user", "content": "another, longer question here"}]}, "chat")
    assert a.prefix_key is not None and a.prefix_key == b.prefix_key
    assert a.prefix_tokens == b.prefix_tokens == 1 + text.CHAT_TOKENS_PER_MESSAGE + text.count_text_tokens(
        system["content"])
    assert a.prefix_tokens < a.prompt_tokens
    other = parse({"messages": [{"role": "system", "content": "Be verbose."},
                                {"role": "user", "content": "first question"}]}, "chat")
    assert other.prefix_key != a.prefix_key
    assert parse({"messages": [{"role": "user", "content": "no system"}]}, "chat").prefix_key is None
    assert parse({"prompt": "completion"}).prefix_key is None


def test_several_served_names():
    names = ("llama", "meta-llama/Llama-3.1-8B-Instruct")
    req = proto.parse_generation_request({"model": "llama", "prompt": "x"}, "completion",
                                         served_model_name=names, max_model_len=64)
    assert req.model == "llama"
    assert proto.parse_generation_request({"prompt": "x"}, "completion", served_model_name=names,
                                          max_model_len=64).model == "llama"
    with pytest.raises(proto.OpenAIError):
        proto.parse_generation_request({"model": "other", "prompt": "x"}, "completion",
                                       served_model_name=names, max_model_len=64)
    body = proto.models_body(names, "meta-llama/Llama-3.1-8B-Instruct", 64, created=1)
    assert [m["id"] for m in body["data"]] == list(names)
    assert {m["root"] for m in body["data"]} == {"meta-llama/Llama-3.1-8B-Instruct"}


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize(("piece", "finish"), [(" the", None), (" of", "length"), ('"quoted" \\ é', "stop"),
                                               ("", "abort")])
def test_token_chunk_template_is_byte_identical_to_the_dict_path(kind, piece, finish):
    body = {"prompt": "x"} if kind == "completion" else {"messages": [{"role": "user", "content": "x"}]}
    req = parse({**body, "model": MODEL, "stream": True}, kind)
    encoder = proto.TokenChunkEncoder(req, "id-1", 1700000000)
    expected = proto.sse(proto.stream_chunk(req, "id-1", 1700000000, text=piece, finish_reason=finish))
    assert encoder.token(piece, finish) == expected


# vLLM 0.32's own refusals, messages as its server writes them (str(VLLMValidationError) names the
# parameter and the value); checked against vllm/sampling_params.py of the installed 0.32 build.
@pytest.mark.parametrize(("body", "kind", "message"), [
    ({"prompt": "x", "logprobs": 21}, "completion",
     "Requested sample logprobs of 21, which is greater than max allowed: 20 (parameter=logprobs, value=21)"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 30}, "chat",
     "Requested sample logprobs of 30, which is greater than max allowed: 20 (parameter=logprobs, value=30)"),
    ({"prompt": "x", "logit_bias": {"abc": 1}}, "completion",
     "logit_bias contains key(s) that cannot be converted to integer token IDs: ['abc'] "
     "(parameter=logit_bias, value=['abc'])"),
    ({"prompt": "x", "logit_bias": {"12": 1, "1.5": -1, "": 2}}, "completion",
     "logit_bias contains key(s) that cannot be converted to integer token IDs: ['1.5', ''] "
     "(parameter=logit_bias, value=['1.5', ''])"),
])
def test_refuses_what_vllm_refuses_with_its_message(body, kind, message):
    with pytest.raises(proto.OpenAIError) as info:
        parse(body, kind)
    assert info.value.message == message and info.value.status == 400
    assert info.value.param == message.split("(parameter=")[1].split(",")[0]


def test_accepts_what_vllm_accepts():
    # logprobs up to max_logprobs (20); keys int() takes; best_of of any value is not a field of
    # vLLM 0.32's requests, which ignore it.
    parse({"prompt": "x", "logprobs": 20, "logit_bias": {"7": 1, " 8": -1, "+9": 0.5}})
    parse({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 20}, "chat")
    for best_of in (True, 5, "x"):
        parse({"prompt": "x", "best_of": best_of})


def test_a_long_list_of_bad_logit_bias_keys_is_shown_briefly():
    with pytest.raises(proto.OpenAIError) as info:
        parse({"prompt": "x", "logit_bias": {f"k{i}" + "z" * 100: 1 for i in range(1000)}})
    assert len(info.value.message) < 1000


def _peak_mb(fn) -> float:
    tracemalloc.start()
    try:
        with pytest.raises(proto.OpenAIError) as info:
            fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert "maximum context length is 1024 tokens" in info.value.message
    return peak / 2**20


def test_a_token_id_list_too_long_is_refused_before_it_is_joined():
    """The seed joins the ids into one string (2M ids: ~120 MB of str objects on the way); a list
    the length check refuses never gets that far."""
    ids = list(range(100_000, 2_100_000))
    assert _peak_mb(lambda: parse({"prompt": ids})) < 5


def test_a_text_prompt_far_too_long_is_counted_only_so_far():
    prompt = "word " * 2_000_000  # 2M tokens against 1024
    with pytest.raises(proto.OpenAIError) as info:
        parse({"prompt": prompt, "max_tokens": 5})
    assert info.value.message == (
        "This model's maximum context length is 1024 tokens. However, you requested more than 2053 tokens "
        "(more than 2048 in the messages, 5 in the completion). Please reduce the length of the messages or "
        "completion.")
    with pytest.raises(proto.OpenAIError) as info:
        parse({"messages": [{"role": "user", "content": prompt}]}, "chat")
    assert "more than 2048 in the messages" in info.value.message
    # Just over the limit, the count is exact, as vLLM reports it.
    with pytest.raises(proto.OpenAIError) as info:
        parse({"prompt": "word " * 1500})
    assert "you requested 1501 tokens (1501 in the messages, 0 in the completion)" in info.value.message
