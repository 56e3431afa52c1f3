"""The OpenAI-compatible request and response bodies of the twin's HTTP server, as pure functions.

Parsing turns a decoded JSON body into a `GenerationRequest`, or raises `OpenAIError` naming the
field and what is allowed, with the status vLLM's server would answer (400, or 404 for an unknown
model).  Builders turn generated text into the bodies and stream chunks vLLM sends.  Nothing here
does I/O, so all of it is unit-tested without a server.
"""

from __future__ import annotations

import functools
import json
import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvpilot.twin import text as tokens

Kind = Literal["completion", "chat"]


class OpenAIError(Exception):
    """An error answered as OpenAI's `{"error": {message, type, param, code}}` body."""

    _TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
              405: "MethodNotAllowedError", 408: "RequestTimeoutError", 413: "RequestEntityTooLargeError",
              415: "UnsupportedMediaTypeError", 431: "RequestHeaderFieldsTooLargeError",
              503: "ServiceUnavailableError", 500: "InternalServerError"}

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.retry_after = retry_after  # seconds, for a Retry-After header (a 503 under load)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self._TYPES.get(self.status, "Error"),
                          "param": self.param, "code": self.status}}


@dataclass(frozen=True)
class GenerationRequest:
    """What the server needs from a completion or chat completion request."""

    kind: Kind
    model: str
    prompt_tokens: int
    max_tokens: int            # resolved: the request's value, or what is left of max_model_len
    max_tokens_param: int | None  # as the client sent it (vLLM's request_params_max_tokens)
    output_seed: int           # seeds the text and the natural (EOS) length
    stream: bool = False
    include_usage: bool = False
    continuous_usage_stats: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    # A shareable prompt prefix (a chat's leading system message) for the engine's prefix cache:
    # requests with the same key reuse its full KV blocks, as vLLM's hash-based cache would.
    prefix_key: str | None = None
    prefix_tokens: int = 0
    # Sampling parameters as vLLM resolves them (its defaults when the client sends none); the twin
    # samples nothing, but vLLM's request span reports them.
    temperature: float = 1.0
    top_p: float = 1.0

    def output_budget(self) -> tuple[int, bool]:
        """Tokens to generate, and whether stopping there is an end-of-sequence ("stop") rather
        than the max_tokens limit ("length")."""
        if self.ignore_eos:
            return self.max_tokens, False
        natural = max(tokens.natural_output_length(self.output_seed), self.min_tokens)
        if natural < self.max_tokens:
            return natural, True
        return self.max_tokens, False


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _brief(value: Any) -> str:
    """A JSON rendering of a client's value for an error message, never longer than ~60 characters."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str) and len(value) > 40:
        return json.dumps(value[:40])[:-1] + '..."'
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return "a very large integer"
    return json.dumps(value)


_INT64 = (-(1 << 63), (1 << 63) - 1)


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool)


def _is_str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _is_int_list(value: Any) -> bool:
    return isinstance(value, list) and all(_is_int(v) for v in value)


def _is_object(value: Any) -> bool:
    return isinstance(value, dict)


def _is_logit_bias(value: Any) -> bool:
    return isinstance(value, dict) and all(_is_number(v) for v in value.values())


# vLLM's --max-logprobs default (ModelConfig.max_logprobs): more sample logprobs are refused.
MAX_LOGPROBS = 20


def _vllm_validation_error(message: str, param: str, value: Any) -> OpenAIError:
    """vLLM's VLLMValidationError as its server answers it: str(exc) names the parameter and value."""
    return OpenAIError(f"{message} (parameter={param}, value={value})", param=param)


def _int_key(key: str) -> bool:
    try:
        int(key)  # vLLM's conversion: " 7", "+7" and "1_000" are token ids too
    except ValueError:
        return False
    return True


def _check_logit_bias_keys(value: dict[str, Any]) -> None:
    invalid = [k for k in value if not _int_key(k)]
    if invalid:
        # vLLM lists every key; a hostile body could send thousands, so the message shows five.
        shown = [k if len(k) <= 30 else k[:30] + "..." for k in invalid[:5]]
        raise _vllm_validation_error(
            f"logit_bias contains key(s) that cannot be converted to integer token IDs: {shown!r}",
            "logit_bias", shown)


def _check_max_logprobs(count: int) -> None:
    if count > MAX_LOGPROBS:
        raise _vllm_validation_error(
            f"Requested sample logprobs of {count}, which is greater than max allowed: {MAX_LOGPROBS}",
            "logprobs", count)


# Optional fields of vLLM's CompletionRequest / ChatCompletionRequest that the twin ignores, with
# the type vLLM's pydantic model gives them: a wrong type is a 400 there, so it is one here.
_OPTIONAL_TYPES: dict[str, tuple[Any, str]] = {
    "stop": (lambda v: _is_str(v) or _is_str_list(v), "a string or an array of strings"),
    "stop_token_ids": (_is_int_list, "an array of integers"),
    "seed": (lambda v: _is_int(v) and _INT64[0] <= v <= _INT64[1], "a 64-bit integer"),
    "user": (_is_str, "a string"),
    "suffix": (_is_str, "a string"),
    "logit_bias": (_is_logit_bias, "an object mapping token ids to numbers"),
    "response_format": (_is_object, "an object"),
    "tools": (lambda v: isinstance(v, list) and all(_is_object(t) for t in v), "an array of objects"),
    "tool_choice": (lambda v: _is_str(v) or _is_object(v), "a string or an object"),
    "top_k": (lambda v: _is_int(v) and v >= -1, "an integer, -1 or more"),
    "min_p": (lambda v: _is_number(v) and 0 <= v <= 1, "a number between 0 and 1"),
    "repetition_penalty": (lambda v: _is_number(v) and v > 0, "a number greater than 0"),
    "length_penalty": (_is_number, "a finite number"),
    "priority": (_is_int, "an integer"),
    "echo": (_is_bool, "true or false"),
    "skip_special_tokens": (_is_bool, "true or false"),
    "spaces_between_special_tokens": (_is_bool, "true or false"),
    "include_stop_str_in_output": (_is_bool, "true or false"),
    "add_special_tokens": (_is_bool, "true or false"),
    "add_generation_prompt": (_is_bool, "true or false"),
    "continue_final_message": (_is_bool, "true or false"),
    "parallel_tool_calls": (_is_bool, "true or false"),
    "chat_template_kwargs": (_is_object, "an object"),
}
# `logprobs` is a count for completions and a switch for chat, as in OpenAI's API.
_LOGPROBS: dict[str, tuple[Any, str]] = {
    "completion": (lambda v: _is_int(v) and v >= 0, "an integer, 0 or more"),
    "chat": (_is_bool, "true or false"),
}


def _check_optional_types(body: dict[str, Any], kind: Kind) -> None:
    for name, (ok, allowed) in _OPTIONAL_TYPES.items():
        value = body.get(name)
        if value is not None and not ok(value):
            raise OpenAIError(f"`{name}` must be {allowed}, got {_brief(value)}.", param=name)
    if body.get("logit_bias") is not None:
        _check_logit_bias_keys(body["logit_bias"])
    logprobs = body.get("logprobs")
    ok, allowed = _LOGPROBS[kind]
    if logprobs is not None and not ok(logprobs):
        raise OpenAIError(f"`logprobs` must be {allowed}, got {_brief(logprobs)}.", param="logprobs")
    if kind == "completion" and logprobs is not None:
        _check_max_logprobs(logprobs)
    value = body.get("top_logprobs")
    if kind == "chat" and value is not None:
        if _is_int(value) and value > MAX_LOGPROBS and logprobs is True:
            _check_max_logprobs(value)  # vLLM samples top_logprobs logprobs when logprobs is true
        if not (_is_int(value) and 0 <= value <= MAX_LOGPROBS):
            raise OpenAIError(f"`top_logprobs` must be an integer from 0 to {MAX_LOGPROBS}, got {_brief(value)}.",
                              param="top_logprobs")


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number (RFC 8259 has no NaN or Infinity)")


def decode_json_object(raw: bytes) -> dict[str, Any]:
    """The JSON object of a request body, or a 400 naming what is wrong with it."""
    try:
        body = json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError:  # the C decoder stops at the interpreter's recursion limit
        raise OpenAIError("The request body is not valid JSON: it nests too deeply.") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, integers past Python's digit limit
        raise OpenAIError(f"The request body is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(body, dict):
        raise OpenAIError(f"The request body must be a JSON object, got {type(body).__name__}.")
    return body


def _optional_int(body: dict[str, Any], name: str, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value):
        raise OpenAIError(f"`{name}` must be an integer, got {_brief(value)}.", param=name)
    if value < minimum:
        raise OpenAIError(f"`{name}` must be at least {minimum}, got {value}.", param=name)
    return int(value)


def _optional_bool(body: dict[str, Any], name: str, where: str = "") -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise OpenAIError(f"`{where}{name}` must be true or false, got {_brief(value)}.",
                          param=f"{where}{name}")
    return value


def _check_sampling(body: dict[str, Any]) -> None:
    """The twin ignores sampling, but rejects values vLLM rejects, so clients see the same errors."""
    checks = (("temperature", 0.0, None), ("top_p", 0.0, 1.0), ("presence_penalty", -2.0, 2.0),
              ("frequency_penalty", -2.0, 2.0))
    for name, low, high in checks:
        value = body.get(name)
        if value is None:
            continue
        if not _is_number(value):
            raise OpenAIError(f"`{name}` must be a finite number, got {_brief(value)}.", param=name)
        if value < low or (high is not None and value > high) or (name == "top_p" and value == 0):
            allowed = f"in ({low}, {high}]" if name == "top_p" else (
                f"between {low} and {high}" if high is not None else f"at least {low}")
            raise OpenAIError(f"`{name}` must be {allowed}, got {value}.", param=name)
    n = _optional_int(body, "n", 1)
    if n is not None and n != 1:
        raise OpenAIError(f"`n` must be 1: the engine twin generates one choice per request, got {n}.",
                          param="n")
    # `best_of` is not refused: vLLM 0.32 has no such field and ignores it, whatever its value.


def _check_model(body: dict[str, Any], served_model_names: tuple[str, ...]) -> str:
    model = body.get("model")
    if model is None:
        return served_model_names[0]  # vLLM serves its only model when none is named
    if not isinstance(model, str):
        raise OpenAIError(f"`model` must be a string, got {_brief(model)}.", param="model")
    if model not in served_model_names:
        shown = model if len(model) <= 200 else model[:200] + "..."
        raise OpenAIError(f"The model `{shown}` does not exist.", status=404, param="model")
    return model


def _completion_prompt(body: dict[str, Any], max_model_len: int) -> tuple[int, int]:
    """(prompt tokens, seed) from `prompt`: a string, a list of token ids, or a one-item list of either.
    A prompt that cannot fit is counted only as far as `_count_limit` and gets no seed."""
    if "prompt" not in body or body["prompt"] is None:
        raise OpenAIError("`prompt` is required.", param="prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        count = tokens.count_prompt_tokens(prompt, _count_limit(max_model_len))
        return count, tokens.prompt_seed(prompt) if count < max_model_len else 0
    if isinstance(prompt, list):
        if not prompt:
            raise OpenAIError("`prompt` must not be an empty list of token ids.", param="prompt")
        if all(_is_int(t) and t >= 0 for t in prompt):
            # The seed joins the ids into a string: not for a list the length check refuses.
            seed = tokens.prompt_seed(",".join(map(str, prompt))) if len(prompt) < max_model_len else 0
            return len(prompt), seed
        if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
            raise OpenAIError("`prompt` with more than one prompt (a batch) is not supported by the "
                              "engine twin; send one request per prompt.", param="prompt")
    raise OpenAIError("`prompt` must be a string, a list of non-negative token ids, or a one-item "
                      "list of either.", param="prompt")


def _message_text(message: Any, index: int) -> str:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise OpenAIError(f"`{where}` must be an object with `role` and `content`.", param=where)
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise OpenAIError(f"`{where}.role` must be a non-empty string.", param=f"{where}.role")
    content = message.get("content")
    if content is None:
        return ""  # e.g. an assistant turn that only carried tool calls
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            pwhere = f"{where}.content[{j}]"
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise OpenAIError(f"`{pwhere}` must be a {{\"type\": \"text\", \"text\": ...}} part; "
                                  f"the engine twin takes text only, got {_brief(kind)}.",
                                  param=pwhere)
            if not isinstance(part.get("text"), str):
                raise OpenAIError(f"`{pwhere}.text` must be a string.", param=f"{pwhere}.text")
            texts.append(part["text"])
        return "\n".join(texts)
    raise OpenAIError(f"`{where}.content` must be a string or a list of text parts.",
                      param=f"{where}.content")


def _count_limit(max_model_len: int) -> int:
    """How far a prompt is counted: far enough past max_model_len for the refusal to say how much
    too long it is, not so far that a 32 MB prompt costs seconds."""
    return 2 * max_model_len


def _chat_prompt(body: dict[str, Any], max_model_len: int) -> tuple[int, int, str | None, int]:
    """(prompt tokens, seed, prefix key, prefix tokens) of a chat request."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise OpenAIError("`messages` is required: a non-empty list of {role, content} objects.",
                          param="messages")
    contents = [_message_text(m, i) for i, m in enumerate(messages)]
    roles = "".join(str(m.get("role")) for m in messages)
    prompt = tokens.count_chat_tokens(contents, _count_limit(max_model_len))
    if prompt >= max_model_len:
        return prompt, 0, None, 0  # refused by the length check: no seed, no prefix
    seed = tokens.prompt_seed(roles + "\x00" + "\x00".join(contents))
    if messages[0].get("role") == "system" and len(messages) > 1:
        # BOS + the system message with its template tokens come first in every such prompt.
        prefix = 1 + tokens.CHAT_TOKENS_PER_MESSAGE + tokens.count_text_tokens(contents[0])
        return prompt, seed, f"system:{tokens.prompt_seed(contents[0]):08x}", prefix
    return prompt, seed, None, 0


def parse_generation_request(body: dict[str, Any], kind: Kind, *, served_model_name: str | Sequence[str],
                             max_model_len: int) -> GenerationRequest:
    """Validate a /v1/completions (kind "completion") or /v1/chat/completions ("chat") body.
    `served_model_name` is one name or all of them (`--served-model-name a b`)."""
    names = (served_model_name,) if isinstance(served_model_name, str) else tuple(served_model_name)
    model = _check_model(body, names)
    prefix_key: str | None = None
    prefix_tokens = 0
    if kind == "completion":
        prompt_tokens, seed = _completion_prompt(body, max_model_len)
    else:
        prompt_tokens, seed, prefix_key, prefix_tokens = _chat_prompt(body, max_model_len)
    max_tokens = _optional_int(body, "max_tokens", 1)
    if kind == "chat":
        # The newer name wins when both are sent, as in vLLM.
        max_completion = _optional_int(body, "max_completion_tokens", 1)
        if max_completion is not None:
            max_tokens = max_completion
    min_tokens = _optional_int(body, "min_tokens", 0) or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise OpenAIError(f"`min_tokens` ({min_tokens}) must not exceed `max_tokens` ({max_tokens}).",
                          param="min_tokens")
    _check_sampling(body)
    _check_optional_types(body, kind)
    stream = _optional_bool(body, "stream")
    options = body.get("stream_options")
    include_usage = continuous = False
    if options is not None:
        if not isinstance(options, dict):
            raise OpenAIError("`stream_options` must be an object.", param="stream_options")
        if not stream:
            raise OpenAIError("Stream options can only be defined when `stream=True`.",
                              param="stream_options")
        include_usage = _optional_bool(options, "include_usage", "stream_options.")
        continuous = _optional_bool(options, "continuous_usage_stats", "stream_options.")
    ignore_eos = _optional_bool(body, "ignore_eos")

    # vLLM's length check and wording: the prompt plus the completion must fit max_model_len.
    if prompt_tokens >= max_model_len or (max_tokens is not None
                                          and prompt_tokens + max_tokens > max_model_len):
        asked = prompt_tokens + (max_tokens or 0)
        # A prompt counted only as far as _count_limit: its figures are lower bounds.
        more = "more than " if prompt_tokens > _count_limit(max_model_len) else ""
        shown = _count_limit(max_model_len) if more else prompt_tokens
        raise OpenAIError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{more}{shown + (max_tokens or 0) if more else asked} tokens ({more}{shown} in the messages, "
            f"{max_tokens or 0} in the completion). Please reduce the length of the messages or completion.",
            param="max_tokens" if max_tokens is not None and prompt_tokens < max_model_len else "prompt")
    resolved = max_tokens if max_tokens is not None else max_model_len - prompt_tokens
    temperature, top_p = body.get("temperature"), body.get("top_p")  # numbers: _check_sampling saw them
    return GenerationRequest(kind=kind, model=model, prompt_tokens=prompt_tokens, max_tokens=resolved,
                             max_tokens_param=max_tokens, output_seed=seed, stream=stream,
                             include_usage=include_usage, continuous_usage_stats=continuous,
                             ignore_eos=ignore_eos, min_tokens=min_tokens, prefix_key=prefix_key,
                             prefix_tokens=prefix_tokens,
                             temperature=1.0 if temperature is None else float(temperature),
                             top_p=1.0 if top_p is None else float(top_p))


# --------------------------------------------------------------------------- responses


def new_request_id(kind: Kind) -> str:
    return ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def full_response(req: GenerationRequest, request_id: str, created: int, text: str,
                  completion_tokens: int, finish_reason: str) -> dict[str, Any]:
    """The non-streaming body."""
    if req.kind == "completion":
        choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None,
                                  "finish_reason": finish_reason, "stop_reason": None}
        obj = "text_completion"
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": text, "tool_calls": []},
                  "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}
        obj = "chat.completion"
    return {"id": request_id, "object": obj, "created": created, "model": req.model,
            "choices": [choice], "usage": usage(req.prompt_tokens, completion_tokens)}


def stream_chunk(req: GenerationRequest, request_id: str, created: int, *, text: str | None,
                 finish_reason: str | None, role: bool = False,
                 usage_so_far: dict[str, int] | None = None) -> dict[str, Any]:
    """One streamed chunk.  `text=None` with `role=True` is the chat role announcement."""
    if req.kind == "completion":
        choice: dict[str, Any] = {"index": 0, "text": text or "", "logprobs": None,
                                  "finish_reason": finish_reason}
        obj = "text_completion"
    else:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {"content": text or ""}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    chunk: dict[str, Any] = {"id": request_id, "object": obj, "created": created, "model": req.model,
                             "choices": [choice]}
    if usage_so_far is not None:
        chunk["usage"] = usage_so_far
    return chunk


def usage_chunk(req: GenerationRequest, request_id: str, created: int,
                completion_tokens: int) -> dict[str, Any]:
    """The final chunk for `stream_options.include_usage`: empty choices, usage filled in."""
    obj = "text_completion" if req.kind == "completion" else "chat.completion.chunk"
    return {"id": request_id, "object": obj, "created": created, "model": req.model, "choices": [],
            "usage": usage(req.prompt_tokens, completion_tokens)}


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event as vLLM writes it: `data: ...` and a blank line."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


@functools.lru_cache(maxsize=4096)
def _json_str(value: str | None) -> bytes:
    return json.dumps(value).encode()


class TokenChunkEncoder:
    """The SSE bytes of one request's token chunks, from a template built once per request.

    A busy twin streams hundreds of requests a token per engine step each; building and
    serialising a dict per token costs more CPU than the engine step itself.  The bytes are
    exactly `sse(stream_chunk(...))` for a token chunk without usage (a unit test holds them to
    it); chunks with usage go through `stream_chunk`."""

    def __init__(self, req: GenerationRequest, request_id: str, created: int) -> None:
        head = {"id": request_id, "object": "text_completion" if req.kind == "completion"
                else "chat.completion.chunk", "created": created, "model": req.model}
        opening = json.dumps(head, separators=(",", ":"))[:-1]  # without the closing brace
        if req.kind == "completion":
            self._prefix = f'data: {opening},"choices":[{{"index":0,"text":'.encode()
            self._middle = b',"logprobs":null,"finish_reason":'
        else:
            self._prefix = f'data: {opening},"choices":[{{"index":0,"delta":{{"content":'.encode()
            self._middle = b'},"logprobs":null,"finish_reason":'
        self._suffix = b"}]}\n\n"

    def token(self, text: str, finish_reason: str | None) -> bytes:
        return b"".join((self._prefix, _json_str(text), self._middle, _json_str(finish_reason), self._suffix))


def models_body(served_model_name: str | Sequence[str], root: str, max_model_len: int,
                created: int | None = None) -> dict:
    """/v1/models: one entry per served name, each rooted at the model it serves."""
    created = int(time.time()) if created is None else created
    names = (served_model_name,) if isinstance(served_model_name, str) else tuple(served_model_name)
    return {"object": "list", "data": [{
        "id": name, "object": "model", "created": created, "owned_by": "vllm",
        "root": root, "parent": None, "max_model_len": max_model_len, "permission": [],
    } for name in names]}
