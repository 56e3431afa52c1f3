"""`kvpilot twin serve` as a real process: the official openai client, /metrics, malformed requests,
client disconnects and the load generator, against one shared twin (a small model on a fast GPU,
so each request takes milliseconds)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.twin_process import FAST_TWIN_ARGS, TwinProcess, twin_server
from kvpilot.api import vllm
from kvpilot.loadgen import run_load_sync

pytestmark = pytest.mark.integration

MODEL = "Qwen2.5-0.5B"


@pytest.fixture(scope="module")
def twin(tmp_path_factory) -> TwinProcess:
    with twin_server(*FAST_TWIN_ARGS, "--max-num-seqs", "64", "--max-num-batched-tokens", "1024",
                     log_dir=tmp_path_factory.mktemp("twin"), log_level="debug") as proc:
        yield proc


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def post(url: str, data: bytes, content_type: str = "application/json") -> tuple[int, dict | None, str]:
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            status, raw, ctype = resp.status, resp.read(), resp.headers.get("Content-Type", "")
    except urllib.error.HTTPError as exc:
        status, raw, ctype = exc.code, exc.read(), exc.headers.get("Content-Type", "")
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    return status, body, ctype


def metric_families(twin: TwinProcess) -> dict:
    status, raw = get(twin.metrics_url)
    assert status == 200
    return {f.name: f for f in text_string_to_metric_families(raw.decode())}


def value(fams: dict, family: str, sample: str, **labels: str) -> float:
    for s in fams[family].samples:
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise AssertionError(f"no {sample} {labels}")


def aborted_count(fams: dict, labels: dict) -> float:
    """Requests the twin aborted, which must leave vLLM's own finished-request counter alone."""
    assert value(fams, "vllm:request_success", "vllm:request_success_total", finished_reason="abort",
                 **labels) == 0
    return value(fams, "kvpilot_twin_aborted_requests", "kvpilot_twin_aborted_requests_total", **labels)


def wait_for(predicate, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_harness_metric_helpers(twin):
    assert twin.metric_value("vllm:request_success_total", finished_reason="abort") is not None
    assert twin.metric_value("vllm:time_to_first_token_seconds_bucket", le="0.5") is not None
    assert twin.metric_value("vllm:no_such_metric") is None
    assert "vllm:request_success" in twin.metric_families()


def test_health_models_version(twin):
    assert get(twin.health_url)[0] == 200
    status, raw = get(twin.base_url + "/v1/models")
    models = json.loads(raw)
    assert status == 200 and models["data"][0]["id"] == MODEL and models["data"][0]["root"] == MODEL
    assert json.loads(get(twin.base_url + "/version")[1])["version"] == vllm.VLLM_VERSION


def test_openai_client_streams_a_completion(twin):
    client = openai.OpenAI(base_url=twin.openai_url, api_key="unused", max_retries=0)
    assert client.models.list().data[0].id == MODEL
    stream = client.completions.create(model=MODEL, prompt="Tell me about chunked prefill", max_tokens=12,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
    assert len(pieces) == 12 and all(p.startswith(" ") and p.strip() for p in pieces)
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == 12 and usage.prompt_tokens > 0
    # the same prompt writes the same text, streaming or not
    full = client.completions.create(model=MODEL, prompt="Tell me about chunked prefill", max_tokens=12,
                                     extra_body={"ignore_eos": True})
    assert full.choices[0].text == "".join(pieces)
    assert full.usage.completion_tokens == 12


def test_openai_client_streams_a_chat_completion(twin):
    client = openai.OpenAI(base_url=twin.openai_url, api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model=MODEL, max_completion_tokens=7, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "system", "content": "You are terse."},
                  {"role": "user", "content": [{"type": "text", "text": "What is a KV cache?"}]}])
    roles, contents, finish, usage = [], [], None, None
    for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta
            if delta.role:
                roles.append(delta.role)
            if delta.content:
                contents.append(delta.content)
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    assert roles == ["assistant"]
    # without ignore_eos the "model" may stop on its own before max tokens; it wrote at least one
    assert 1 <= len(contents) <= 7
    assert finish == ("length" if len(contents) == 7 else "stop")
    assert usage.completion_tokens == len(contents)
    reply = client.chat.completions.create(model=MODEL, max_tokens=5, extra_body={"ignore_eos": True},
                                           messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].message.role == "assistant"
    assert len(reply.choices[0].message.content.split()) == 5
    assert reply.choices[0].finish_reason == "length"


def test_openai_client_sees_errors_as_exceptions(twin):
    client = openai.OpenAI(base_url=twin.openai_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=10_000)
    assert "maximum context length is 4096 tokens" in str(info.value)


MALFORMED = [
    # (path, raw body, status, param)
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[]", 400, None),
    ("/v1/completions", b"", 400, None),
    ("/v1/completions", b'{"max_tokens": 5}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 0}', 400, "max_tokens"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": -1}', 400, "max_tokens"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": "many"}', 400, "max_tokens"),
    ("/v1/completions", b'{"prompt": {"a": 1}}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": "x", "stream": "yes"}', 400, "stream"),
    ("/v1/completions", b'{"prompt": "x", "model": "gpt-4"}', 404, "model"),
    ("/v1/completions", json.dumps({"prompt": "w " * 5000}).encode(), 400, "prompt"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 5000}', 400, "max_tokens"),
    ("/v1/chat/completions", b'{"messages": []}', 400, "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user"}], "max_completion_tokens": 0}', 400,
     "max_completion_tokens"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', 400,
     "messages[0].content[0]"),
    ("/v1/chat/completions", b'{"messages": [{"content": "hi"}]}', 400, "messages[0].role"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "n": 3}', 400, "n"),
]


@pytest.mark.parametrize(("path", "raw", "status", "param"), MALFORMED,
                         ids=[f"{p.rsplit('/', 1)[1]}-{r[:30]!r}" for p, r, *_ in MALFORMED])
def test_malformed_requests_get_openai_errors(twin, path, raw, status, param):
    got, body, ctype = post(twin.base_url + path, raw)
    assert got == status
    assert ctype.startswith("application/json")
    assert body is not None and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == status and body["error"]["param"] == param
    assert body["error"]["message"]


def test_wrong_method_and_unknown_path_are_json_errors_too(twin):
    status, raw = get(twin.base_url + "/v1/completions")
    assert status == 405 and json.loads(raw)["error"]["code"] == 405
    status, raw = get(twin.base_url + "/v1/nothing-here")
    assert status == 404 and json.loads(raw)["error"]["code"] == 404


def test_metrics_names_edges_and_counts(twin):
    before = metric_families(twin)
    labels = {"model_name": MODEL, "engine": "0"}
    n0 = value(before, vllm.METRIC_TTFT, vllm.METRIC_TTFT + "_count", **labels)
    ok0 = value(before, "vllm:request_success", "vllm:request_success_total", finished_reason="length", **labels)
    gen0 = value(before, "vllm:generation_tokens", "vllm:generation_tokens_total", **labels)
    result = run_load_sync(twin.base_url, num_requests=6, concurrency=3, seed=1, max_tokens=5, model=MODEL)
    assert len(result.succeeded()) == 6
    after = metric_families(twin)
    assert value(after, vllm.METRIC_TTFT, vllm.METRIC_TTFT + "_count", **labels) == n0 + 6
    assert value(after, "vllm:request_success", "vllm:request_success_total", finished_reason="length",
                 **labels) == ok0 + 6
    assert value(after, "vllm:generation_tokens", "vllm:generation_tokens_total", **labels) == gen0 + 30
    for name, edges in ((vllm.METRIC_TTFT, vllm.TTFT_BUCKETS), (vllm.METRIC_ITL, vllm.ITL_BUCKETS),
                        (vllm.METRIC_E2E, vllm.REQUEST_LATENCY_BUCKETS),
                        (vllm.METRIC_QUEUE, vllm.REQUEST_LATENCY_BUCKETS),
                        (vllm.METRIC_PREFILL, vllm.REQUEST_LATENCY_BUCKETS),
                        (vllm.METRIC_DECODE, vllm.REQUEST_LATENCY_BUCKETS)):
        got = [float(s.labels["le"]) for s in after[name].samples if s.name == name + "_bucket"]
        assert got == [*edges, float("inf")], name
        assert all(s.labels["model_name"] == MODEL and s.labels["engine"] == "0" for s in after[name].samples)
    for gauge in (vllm.METRIC_RUNNING, vllm.METRIC_WAITING, vllm.METRIC_KV_USAGE):
        assert after[gauge].type == "gauge"
        assert value(after, gauge, gauge, **labels) == 0  # idle again
    info = after[vllm.METRIC_CACHE_CONFIG].samples[0].labels
    assert info["block_size"] == "16" and info["gpu_memory_utilization"] == "0.92"
    assert int(info["num_gpu_blocks"]) > 0 and info["engine"] == "0"
    assert value(after, vllm.METRIC_ITERATION_TOKENS, vllm.METRIC_ITERATION_TOKENS + "_count", **labels) > 0
    # the twin's own pacing counters: it ran steps and simulated time passed
    assert value(after, "kvpilot_twin_engine_steps", "kvpilot_twin_engine_steps_total", **labels) >= 5
    assert value(after, "kvpilot_twin_simulated_seconds", "kvpilot_twin_simulated_seconds_total", **labels) > 0
    assert value(after, "kvpilot_twin_behind_seconds", "kvpilot_twin_behind_seconds_total", **labels) >= 0


def test_client_disconnect_aborts_the_request(twin):
    import http.client

    labels = {"model_name": MODEL, "engine": "0"}
    aborted0 = aborted_count(metric_families(twin), labels)
    conn = http.client.HTTPConnection(twin.host, twin.port, timeout=10)
    conn.request("POST", "/v1/completions", body=json.dumps(
        {"prompt": "long", "max_tokens": 3000, "ignore_eos": True, "stream": True}),
        headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: ")  # the stream is running
    conn.sock.close()
    conn.close()

    def aborted_and_idle():
        fams = metric_families(twin)
        return (aborted_count(fams, labels) == aborted0 + 1
                and value(fams, vllm.METRIC_RUNNING, vllm.METRIC_RUNNING, **labels) == 0)

    wait_for(aborted_and_idle, what="the disconnected request to be aborted in the engine")


def test_loadgen_open_loop_records_every_token(twin):
    result = run_load_sync(twin.base_url, num_requests=12, rate=40.0, seed=3, max_tokens=6,
                           endpoint="chat", max_duration_s=30)
    assert not result.deadline_hit and len(result.records) == 12 and not result.failed()
    for rec in result.records:
        assert rec.output_chunks == 6 and rec.completion_tokens == 6 and len(rec.itls) == 5
        assert rec.ttft is not None and 0 < rec.ttft <= rec.e2e
        assert rec.finish_reason == "length"
    # exact fractions: every request's TTFT is under its own e2e, none under zero
    assert result.fraction_ttft_at_most(max(result.ttfts())) == 1
    assert result.fraction_ttft_at_most(0.0) == 0
    assert result.fraction_itl_at_most(max(result.itls())) == 1
    summary = result.summary()
    assert summary["succeeded"] == 12 and summary["output_tokens"] == 72


def _simulated_times(args: tuple[str, ...], prompt_tokens: int, max_tokens: int) -> tuple[float, float]:
    """(TTFT, e2e) of one request alone in an engine built from the same flags, in simulated time."""
    import argparse

    from kvpilot.twin.engine import Engine
    from kvpilot.twin.flags import add_engine_arguments, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    engine = Engine(engine_config_from_args(parser.parse_args(list(args))))
    engine.add_request("r", prompt_tokens, max_tokens, 0.0)
    clock, ttft = 0.0, None
    while engine.has_unfinished_requests():
        out = engine.step()
        clock += out.duration_s
        if ttft is None and any(o.new_token_count for o in out.outputs):
            ttft = clock
    assert ttft is not None
    return ttft, clock


def test_tokens_are_paced_by_the_simulated_engine(twin):
    from kvpilot.twin.text import count_prompt_tokens

    prompt = " ".join(["pacing"] * 3000)  # a long prefill: several chunks of 1024 tokens
    sim_ttft, sim_e2e = _simulated_times((*FAST_TWIN_ARGS, "--max-num-seqs", "64",
                                          "--max-num-batched-tokens", "1024"),
                                         count_prompt_tokens(prompt), 20)
    result = run_load_sync(twin.base_url, num_requests=1, concurrency=1, max_tokens=20,
                           prompt=lambda i: prompt)
    rec = result.records[0]
    assert rec.ok and rec.output_chunks == 20 and rec.prompt_tokens == count_prompt_tokens(prompt)
    # The server sleeps every step's simulated duration before it delivers the step's tokens,
    # so real latencies can only be longer than the simulated ones, never shorter.
    assert rec.ttft >= sim_ttft
    assert rec.e2e >= sim_e2e


def test_loadgen_stops_at_its_deadline_and_the_server_aborts_what_was_cut(twin):
    labels = {"model_name": MODEL, "engine": "0"}
    aborted0 = aborted_count(metric_families(twin), labels)
    result = run_load_sync(twin.base_url, num_requests=2, concurrency=2, max_tokens=3000,
                           max_duration_s=0.5)
    assert result.deadline_hit and len(result.records) == 2
    assert all(not r.ok and "deadline" in (r.error or "") for r in result.records)
    wait_for(lambda: aborted_count(metric_families(twin), labels) == aborted0 + 2,
             what="both cut requests to be aborted in the engine")


def test_structured_logs_one_json_line_per_request_at_debug(twin):
    reply = post(twin.base_url + "/v1/completions",
                 json.dumps({"prompt": "log me", "max_tokens": 2, "ignore_eos": True}).encode())[1]
    assert reply is not None
    post(twin.base_url + "/v1/completions", b'{"prompt": "x", "max_tokens": 0}')

    def lines():
        recs = twin.log_records()
        done = [r for r in recs if r["msg"] == "request finished" and r.get("request_id") == reply["id"]]
        rejected = [r for r in recs if r["msg"] == "request rejected" and r.get("param") == "max_tokens"]
        return (done, rejected) if done and rejected else None

    done, rejected = wait_for(lines, what="the request log lines")
    rec = done[0]
    assert rec["level"] == "debug" and rec["finish_reason"] == "length" and rec["generated_tokens"] == 2
    assert rec["prompt_tokens"] == reply["usage"]["prompt_tokens"]
    assert 0 <= rec["queue_s"] <= rec["ttft_s"] <= rec["e2e_s"]
    assert rejected[-1]["status"] == 400
    starts = [r for r in twin.log_records() if r["msg"] == "Starting vLLM API server"]
    assert starts and starts[0]["level"] == "info" and starts[0]["url"] == twin.base_url


def test_server_histograms_agree_with_what_clients_measured(twin):
    """The server clocks TTFT from the moment it has the request to the moment it writes the
    first token; the client from before sending to after receiving.  So the server's interval
    lies inside the client's: for every bucket edge, at least as many server observations fall
    at or below it as client measurements do, and the sums are ordered the same way."""
    labels = {"model_name": MODEL, "engine": "0"}

    def snapshot() -> dict[str, float]:
        fams = metric_families(twin)
        snap = {f"le={le}": value(fams, vllm.METRIC_TTFT, vllm.METRIC_TTFT + "_bucket", le=str(le), **labels)
                for le in vllm.TTFT_BUCKETS}
        for suffix in ("_sum", "_count"):
            snap["ttft" + suffix] = value(fams, vllm.METRIC_TTFT, vllm.METRIC_TTFT + suffix, **labels)
            snap["itl" + suffix] = value(fams, vllm.METRIC_ITL, vllm.METRIC_ITL + suffix, **labels)
            snap["e2e" + suffix] = value(fams, vllm.METRIC_E2E, vllm.METRIC_E2E + suffix, **labels)
        return snap

    before = snapshot()
    result = run_load_sync(twin.base_url, num_requests=20, rate=50.0, seed=11, max_tokens=8, prompt_words=200)
    assert len(result.succeeded()) == 20
    after = snapshot()
    delta = {k: after[k] - before[k] for k in after}
    assert delta["ttft_count"] == delta["e2e_count"] == 20
    assert delta["itl_count"] == len(result.itls()) == 20 * 7  # one gap per token after the first
    assert delta["ttft_sum"] <= sum(result.ttfts())
    assert delta["e2e_sum"] <= sum(result.e2es())
    for le in vllm.TTFT_BUCKETS:
        assert delta[f"le={le}"] >= sum(1 for t in result.ttfts() if t <= le), le
