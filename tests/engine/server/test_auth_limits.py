"""The API key guards /v1 (not the probes), and requests over the in-flight limit get 429."""

from __future__ import annotations

import http.client
import json
from collections.abc import Callable

from tests.engine.server.live import EngineServer, get, post

KEY = "sk-test-0123456789"


def test_the_api_key_is_enforced_on_v1_only(make_server: Callable[..., EngineServer]) -> None:
    server = make_server(api_key=KEY)
    body = {"prompt": [1, 2, 3], "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        status, answer = post(server.url, "/v1/completions", body, **headers)
        assert status == 401, headers
        assert answer["error"]["code"] == "invalid_api_key"
        assert get(server.url, "/v1/models", **headers)[0] == 401
    status, _ = post(server.url, "/v1/completions", body, Authorization=f"Bearer {KEY}")
    assert status == 200
    assert get(server.url, "/v1/models", Authorization=f"Bearer {KEY}")[0] == 200
    assert get(server.url, "/healthz")[0] == 200
    assert get(server.url, "/metrics")[0] == 200


def test_requests_over_the_limit_get_429(make_server: Callable[..., EngineServer]) -> None:
    server = make_server(max_concurrent_requests=1)
    host, port = server.url.removeprefix("http://").split(":")
    long = {"prompt": [5] * 20, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(long), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.read(6) == b"data: "  # the first request is generating
    status, answer = post(server.url, "/v1/completions", {"prompt": [1, 2], "max_tokens": 1})
    assert status == 429 and answer["error"]["code"] == "rate_limit_exceeded"
    conn.close()
