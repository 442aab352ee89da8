"""The OpenAI API of the engine server, over real HTTP to uvicorn on 127.0.0.1: answers equal
``LLM.generate``, streams are SSE ending in [DONE], cached tokens are reported, bad requests get
OpenAI error bodies, requests batch, and a client that leaves aborts its request."""

from __future__ import annotations

import http.client
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from cachetier.engine.llm import LLM
from cachetier.engine.sampling import SamplingParams
from tests.engine.server.live import EngineServer, get, metric, post, post_raw, stream

PROMPT = [(i * 7 + 3) % 250 for i in range(50)]  # 3 full blocks of 16 and 2 tokens
CHAT = [{"role": "user", "content": "Why is the sky blue? Say it in one line."}]
ERROR_KEYS = {"message", "type", "param", "code"}


def reference(model: Path, prompts: list[Any], max_tokens: int, chat: bool = False) -> list[Any]:
    llm = LLM(model, kv_cache_bytes=4 << 20, enable_prefix_caching=False)
    if chat:
        prompts = [llm.encode(p, chat=True) for p in prompts]
    return llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens))


def test_greedy_completion_equals_llm_generate(
    shared_server: EngineServer, chat_model_dir: Path
) -> None:
    want = reference(chat_model_dir, ["The sky is", PROMPT], 12)
    for prompt, ref in zip(["The sky is", PROMPT], want):
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "return_token_ids": True}
        status, answer = post(shared_server.url, "/v1/completions", body)
        assert status == 200, answer
        choice = answer["choices"][0]
        assert (choice["token_ids"], choice["text"]) == (ref.token_ids, ref.text)
        assert answer["object"] == "text_completion" and answer["model"] == "tiny"
        assert choice["finish_reason"] == ref.finish_reason
        usage = answer["usage"]
        assert usage["prompt_tokens"] == len(ref.prompt_token_ids)
        assert usage["completion_tokens"] == len(ref.token_ids)
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_a_repeated_prompt_reports_cached_tokens(shared_server: EngineServer) -> None:
    prompt = [(i * 11 + 5) % 250 for i in range(50)]
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
    hits_before = metric(
        shared_server.url, "cachetier_engine_prefix_cache_hits_total", source="pool"
    )
    _, first = post(shared_server.url, "/v1/completions", body)
    _, second = post(shared_server.url, "/v1/completions", body)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
    # 50 tokens: 3 full blocks served, the 2 past them a cache of whole blocks cannot serve.
    assert second["cachetier"] == {
        "cached_tokens_by_source": {"pool": 48},
        "miss_tokens_by_cause": {"partial_block": 2},
        "miss_tier": "",
        "miss_detail": "",
    }
    assert first["cachetier"]["miss_tokens_by_cause"] == {"never_stored": 48, "partial_block": 2}
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    hits = metric(shared_server.url, "cachetier_engine_prefix_cache_hits_total", source="pool")
    assert hits - hits_before == 48


def test_streamed_completion_is_sse_with_a_usage_chunk(shared_server: EngineServer) -> None:
    body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    _, whole = post(shared_server.url, "/v1/completions", body)
    events = stream(
        shared_server.url, "/v1/completions", {**body, "stream_options": {"include_usage": True}}
    )
    assert events[-1] == "[DONE]"
    chunks, usage_chunk = events[:-2], events[-2]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 10
    assert usage_chunk["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
    assert usage_chunk["cachetier"]["cached_tokens_by_source"] == {"pool": 48}
    without_usage = stream(shared_server.url, "/v1/completions", body)
    assert without_usage[-1] == "[DONE]" and all(e["choices"] for e in without_usage[:-1])


def test_chat_completion_equals_llm_generate_with_the_template(
    shared_server: EngineServer, chat_model_dir: Path
) -> None:
    ref = reference(chat_model_dir, [CHAT[0]["content"]], 8, chat=True)[0]
    body = {"messages": CHAT, "max_tokens": 8, "temperature": 0, "model": "tiny"}
    status, answer = post(shared_server.url, "/v1/chat/completions", body)
    assert status == 200, answer
    assert answer["object"] == "chat.completion"
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": ref.text}
    assert answer["usage"]["prompt_tokens"] == len(ref.prompt_token_ids)

    events = stream(
        shared_server.url,
        "/v1/chat/completions",
        {**body, "stream_options": {"include_usage": True}},
    )
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [e["choices"][0]["delta"] for e in events[1:-3]]
    assert "".join(d.get("content", "") for d in deltas) == ref.text
    assert events[-3]["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": ref.finish_reason,
    }
    # The same conversation again: its full template blocks come from the pool.
    assert events[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_stop_strings_cut_the_text_streamed_or_not(shared_server: EngineServer) -> None:
    body = {"prompt": "hello world", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    _, full = post(shared_server.url, "/v1/completions", body)
    text = full["choices"][0]["text"]
    # Two whole characters from inside the output (no U+FFFD: a real match, not a byte split).
    at = next(i for i in range(1, len(text) - 1) if "\ufffd" not in text[i : i + 2])
    stop = text[at : at + 2]
    _, cut = post(shared_server.url, "/v1/completions", {**body, "stop": [stop, "never"]})
    assert cut["choices"][0]["text"] == text[: text.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"
    events = stream(shared_server.url, "/v1/completions", {**body, "stop": stop})
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == text[: text.index(stop)]
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


def test_four_requests_at_once_all_complete(
    shared_server: EngineServer, chat_model_dir: Path
) -> None:
    prompts = [[(i * k + 1) % 250 for i in range(20 + 9 * k)] for k in range(1, 5)]
    want = [o.token_ids for o in reference(chat_model_dir, prompts, 16)]

    def one(prompt: list[int]) -> list[int]:
        body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "return_token_ids": True}
        status, answer = post(shared_server.url, "/v1/completions", body)
        assert status == 200, answer
        return answer["choices"][0]["token_ids"]

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(one, prompts)) == want


def test_models_healthz_and_metrics(shared_server: EngineServer) -> None:
    status, body = get(shared_server.url, "/v1/models")
    assert status == 200
    models = json.loads(body)
    assert models["object"] == "list"
    assert [(m["id"], m["object"], m["max_model_len"]) for m in models["data"]] == [
        ("tiny", "model", 2048)
    ]
    assert get(shared_server.url, "/healthz")[0] == 200
    post(shared_server.url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3})
    status, text = get(shared_server.url, "/metrics")
    assert status == 200
    for name in (
        "cachetier_engine_kv_cache_usage_perc",
        "cachetier_engine_num_requests_running",
        "cachetier_engine_num_requests_waiting",
        "cachetier_engine_num_preemptions_total",
        "cachetier_engine_prompt_tokens_total",
        "cachetier_engine_generation_tokens_total",
        "cachetier_engine_prefix_cache_queries_total",
        'cachetier_engine_prefix_cache_hits_total{model_name="tiny",source="disk"}',
        "cachetier_engine_request_success_total",
        "cachetier_engine_time_to_first_token_seconds_bucket",
        "cachetier_engine_time_per_output_token_seconds_bucket",
        "cachetier_engine_e2e_request_latency_seconds_bucket",
    ):
        assert name in text.decode(), name
    assert metric(shared_server.url, "cachetier_engine_generation_tokens_total") >= 3
    assert metric(shared_server.url, "cachetier_engine_time_to_first_token_seconds_count") >= 1


@pytest.mark.parametrize(
    "path,body,status,param",
    [
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": [1] * 401}, 400, "prompt"),
        ("/v1/completions", {"prompt": [1, 2, 300]}, 400, "prompt"),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2000}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
        ("/v1/completions", {"prompt": PROMPT, "model": "gpt-4"}, 404, "model"),
        ("/v1/completions", {"prompt": PROMPT, "n": 2}, 400, "n"),
        ("/v1/completions", {"prompt": PROMPT, "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"prompt": PROMPT, "top_k": 0}, 400, "top_k"),
        ("/v1/completions", {"prompt": PROMPT, "stop": [""]}, 400, "stop"),
        ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
        ("/v1/completions", {"prompt": "a lone \ud800 surrogate"}, 400, "prompt"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "a lone \udfff surrogate"}]},
            400,
            "messages",
        ),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "robot", "content": "x"}]},
            400,
            "messages",
        ),
    ],
)
def test_bad_requests_get_openai_errors(
    shared_server: EngineServer, path: str, body: dict[str, Any], status: int, param: str
) -> None:
    got, answer = post(shared_server.url, path, body)
    assert got == status, answer
    assert set(answer["error"]) == ERROR_KEYS
    assert answer["error"]["param"] == param
    assert answer["error"]["message"]


def test_bad_json_and_huge_bodies(shared_server: EngineServer) -> None:
    status, body = post_raw(shared_server.url, "/v1/completions", b'{"prompt": "x",')
    assert status == 400
    assert json.loads(body)["error"]["message"] == "the request body is not valid JSON"
    huge = json.dumps({"prompt": "x" * (2 << 20)}).encode()
    status, body = post_raw(shared_server.url, "/v1/completions", huge)
    assert status == 413 and set(json.loads(body)["error"]) == ERROR_KEYS
    assert json.loads(body)["error"]["code"] == "body_too_large"
    # Without a Content-Length the body is refused once it passes the limit (1 MiB); the
    # client has sent it all by then, so it reads the answer.
    chunks = [b'{"prompt": "' + b"x" * ((1 << 20) - 12), b"x" * 1024 + b'"}']
    status, body = post_raw(shared_server.url, "/v1/completions", chunks)
    assert status == 413 and json.loads(body)["error"]["code"] == "body_too_large", body
    # Unknown fields are ignored, as OpenAI-compatible servers do.
    status, _ = post_raw(
        shared_server.url, "/v1/completions", b'{"prompt": [1, 2], "max_tokens": 1, "foo": 1}'
    )
    assert status == 200


def _open_stream(url: str, path: str, body: dict[str, Any]) -> http.client.HTTPConnection:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    return conn


def _wait_for(condition: Any, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.05)


@pytest.mark.parametrize("streamed", [True, False])
def test_a_client_that_leaves_aborts_its_request(
    shared_server: EngineServer, streamed: bool
) -> None:
    url = shared_server.url
    aborted = metric(url, "cachetier_engine_request_success_total", finished_reason="abort")
    generated = metric(url, "cachetier_engine_generation_tokens_total")
    body = {"prompt": PROMPT, "max_tokens": 1900, "ignore_eos": True, "stream": streamed}
    conn = _open_stream(url, "/v1/completions", body)
    if streamed:
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.read(6) == b"data: "  # generating
    else:
        _wait_for(lambda: metric(url, "cachetier_engine_num_requests_running") == 1, "running")
    conn.sock.close()  # the client goes away mid-request
    conn.close()
    _wait_for(
        lambda: (
            metric(url, "cachetier_engine_request_success_total", finished_reason="abort")
            == aborted + 1
        ),
        "the abort",
    )
    _wait_for(lambda: metric(url, "cachetier_engine_num_requests_running") == 0, "no running")
    assert metric(url, "cachetier_engine_generation_tokens_total") - generated < 1900


def _events_until(resp: http.client.HTTPResponse, want: Any) -> list[Any]:
    """Read a stream's events up to and including the first for which ``want`` holds."""
    events: list[Any] = []
    while True:
        line = resp.readline()
        assert line, f"the stream ended after {events}"
        if line.startswith(b"data: "):
            data = line[6:].strip().decode()
            events.append(data if data == "[DONE]" else json.loads(data))
            if want(events[-1]):
                return events


def test_an_engine_that_dies_sends_an_error_event_mid_answer_and_an_error_before_it(
    make_server: Any,
) -> None:
    # One seat: the first stream runs and the second waits in the queue, before its prefill.
    server = make_server(engine_args={"kv_cache_bytes": 4 << 20, "max_num_seqs": 1})
    body = {"messages": CHAT, "max_tokens": 1900, "ignore_eos": True, "stream": True}
    running = _open_stream(server.url, "/v1/chat/completions", body)
    resp = running.getresponse()
    assert resp.status == 200

    def has_content(event: Any) -> bool:
        return isinstance(event, dict) and bool(event["choices"][0]["delta"].get("content"))

    first = _events_until(resp, has_content)
    assert first[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    waiting = _open_stream(server.url, "/v1/chat/completions", body)
    _wait_for(lambda: metric(server.url, "cachetier_engine_num_requests_waiting") == 1, "queued")
    # The engine thread stops under both (what a failed step does to every request in flight).
    server._server.lifespan.state["serving"].engine.shutdown()  # type: ignore[union-attr]

    rest = _events_until(resp, lambda e: e == "[DONE]")
    error = rest[-2]["error"]
    assert set(error) == ERROR_KEYS and error["type"] == "server_error"
    assert "engine stopped" in error["message"]
    assert resp.read().strip() == b""  # [DONE] was the last event
    # The queued stream had sent nothing, not even its head: it fails as a plain HTTP 503,
    # which a router retries on another replica.
    queued = waiting.getresponse()
    assert queued.status == 503 and json.loads(queued.read())["error"]["type"] == "server_error"
    running.close()
    waiting.close()
