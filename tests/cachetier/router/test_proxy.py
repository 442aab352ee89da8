"""The router as a proxy, over real HTTP to a real engine server: answers pass through streamed
or not, a replica that refuses connections is retried past and leaves the rotation, bad bodies
and missing keys are refused at the router, and every decision is counted in /metrics. A stream
whose replica dies before its first whole event is retried elsewhere; one cut after that ends
with an error event and [DONE], never in silence, and never with half an event."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from tests.engine.server.live import EngineServer, get, metric, post, post_raw, stream
from tests.support import AppThread, refusing_port

PROMPT = [(i * 7 + 3) % 250 for i in range(40)]
BODY = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0}


def test_an_answer_through_the_router_equals_the_replicas(
    replica: EngineServer, make_router: Callable[..., AppThread]
) -> None:
    router = make_router([replica.url])
    status, direct = post(replica.url, "/v1/completions", BODY)
    status_r, routed = post(router.url, "/v1/completions", BODY)
    assert status == status_r == 200
    assert routed["choices"][0]["text"] == direct["choices"][0]["text"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
    assert post(router.url, "/v1/chat/completions", chat)[0] == 200
    events = stream(router.url, "/v1/completions", {**BODY, "stream": True})
    assert events[-1] == "[DONE]" and len(events) >= 2
    status, models = get(router.url, "/v1/models")
    assert status == 200 and json.loads(models)["data"][0]["id"] == "tiny"


def test_a_dead_replica_is_retried_past_and_leaves_the_rotation(
    replica: EngineServer, make_router: Callable[..., AppThread]
) -> None:
    with refusing_port() as dead:  # bound, never listening: connections are refused
        router = make_router([f"http://127.0.0.1:{dead}", replica.url], poll_interval_s=60)
        status, _ = post(router.url, "/v1/completions", BODY)
        assert status == 200
        assert metric(router.url, "cachetier_router_replica_up", replica="r0") == 0
        assert metric(router.url, "cachetier_router_requests_total", replica="r1") == 1
        assert json.loads(get(router.url, "/healthz")[1]) == {"replicas_up": 1}


def test_with_no_replica_up_the_client_gets_503(make_router: Callable[..., AppThread]) -> None:
    with refusing_port() as dead:
        router = make_router([f"http://127.0.0.1:{dead}"])
        status, body = post(router.url, "/v1/completions", BODY)
        assert status == 503 and "no replica answered" in body["error"]["message"]
        assert get(router.url, "/healthz")[0] == 503
        assert metric(router.url, "cachetier_router_unrouted_requests_total") == 1


def test_bad_bodies_and_missing_keys_are_refused_at_the_router(
    replica: EngineServer, make_router: Callable[..., AppThread]
) -> None:
    router = make_router([replica.url], api_key="router-key-0001", max_body_bytes=4096)
    assert post(router.url, "/v1/completions", BODY)[0] == 401
    auth = {"Authorization": "Bearer router-key-0001"}
    assert post_raw(router.url, "/v1/completions", b"{not json", **auth)[0] == 400
    assert post_raw(router.url, "/v1/completions", b"[1, 2]", **auth)[0] == 400
    huge = json.dumps({"prompt": "x" * 10_000}).encode()
    assert post_raw(router.url, "/v1/completions", huge, **auth)[0] == 413
    chunked = [b"x" * 3000, b"y" * 3000]  # no Content-Length: counted as it arrives
    assert post_raw(router.url, "/v1/completions", chunked, **auth)[0] == 413
    assert post_raw(router.url, "/v1/completions", json.dumps(BODY).encode(), **auth)[0] == 200


def _dies_after_its_head() -> AppThread:
    """A replica that is healthy, then answers every request with a head and a broken body:
    an engine killed in the middle of a prefill, after its stream's head went out."""
    app = FastAPI()
    app.get("/healthz")(lambda: {"ok": True})

    async def died() -> AsyncIterator[bytes]:
        raise RuntimeError("killed mid-prefill")
        yield b""  # pragma: no cover - makes this a generator

    @app.post("/v1/completions")
    async def complete() -> StreamingResponse:
        return StreamingResponse(died(), media_type="text/event-stream")

    server = AppThread(lambda: app, name="dying replica")
    server.start_thread()
    return server


def test_a_replica_whose_answer_breaks_before_its_body_is_retried_past(
    replica: EngineServer, make_router: Callable[..., AppThread]
) -> None:
    dying = _dies_after_its_head()
    try:
        router = make_router([dying.url, replica.url], poll_interval_s=60)
        events = stream(router.url, "/v1/completions", BODY)
        assert events[-1] == "[DONE]" and len(events) >= 2  # the whole answer, from r1
        assert metric(router.url, "cachetier_router_replica_up", replica="r0") == 0
        assert metric(router.url, "cachetier_router_retries_total") == 1
    finally:
        dying.stop()


def _scripted_replica(script: list[bytes], then: str) -> AppThread:
    """A healthy replica that answers every request with the SSE events of ``script`` (bytes
    as sent, halves of events included), then dies (``then="die"``: the connection drops
    without the chunked body's end) or closes cleanly (``then="close"``)."""
    app = FastAPI()
    app.get("/healthz")(lambda: {"ok": True})

    async def events() -> AsyncIterator[bytes]:
        for part in script:
            yield part
        if then == "die":
            raise RuntimeError("killed mid-answer")

    @app.post("/v1/completions")
    async def complete() -> StreamingResponse:
        return StreamingResponse(events(), media_type="text/event-stream")

    server = AppThread(lambda: app, name="scripted replica")
    server.start_thread()
    return server


def _chunk(text: str) -> bytes:
    body = {"object": "text_completion", "choices": [{"index": 0, "text": text}]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def test_a_stream_cut_mid_answer_ends_with_an_error_event_not_silence(
    make_router: Callable[..., AppThread],
) -> None:
    half = _chunk("never whole")[:20]
    for then, script in (
        ("die", [_chunk("one"), _chunk("two"), half]),  # killed inside its third event
        ("close", [_chunk("one"), _chunk("two")]),  # closed cleanly, but without [DONE]
    ):
        cut = _scripted_replica(script, then)
        try:
            router = make_router([cut.url], poll_interval_s=60)
            events = stream(router.url, "/v1/completions", BODY)  # every event parses whole
            assert [e["choices"][0]["text"] for e in events[:2]] == ["one", "two"], then
            error = events[2]["error"]
            assert error["type"] == "server_error" and error["code"] == "replica_failed", then
            assert "r0" in error["message"] and events[3:] == ["[DONE]"], then
            assert metric(router.url, "cachetier_router_replica_up", replica="r0") == 0
        finally:
            cut.stop()


def test_a_replica_that_dies_inside_its_first_event_is_retried_past(
    replica: EngineServer, make_router: Callable[..., AppThread]
) -> None:
    # Bytes arrived, but not one whole event: nothing went to the client, so a retry is safe.
    dying = _scripted_replica([_chunk("lost")[:25]], "die")
    try:
        router = make_router([dying.url, replica.url], poll_interval_s=60)
        events = stream(router.url, "/v1/completions", BODY)
        assert events[-1] == "[DONE]" and all("error" not in e for e in events[:-1])
        assert "lost" not in json.dumps(events)
        assert metric(router.url, "cachetier_router_retries_total") == 1
    finally:
        dying.stop()


def test_a_whole_stream_passes_through_unchanged(
    make_router: Callable[..., AppThread],
) -> None:
    # Events split across reads anywhere, [DONE] last: passed on as sent, nothing added.
    whole = _chunk("a") + _chunk("b") + b"data: [DONE]\n\n"
    script = [whole[i : i + 7] for i in range(0, len(whole), 7)]
    done = _scripted_replica(script, "close")
    try:
        router = make_router([done.url], poll_interval_s=60)
        status, body = post_raw(router.url, "/v1/completions", json.dumps(BODY).encode())
        assert status == 200 and body == whole
        assert metric(router.url, "cachetier_router_replica_up", replica="r0") == 1
    finally:
        done.stop()
