"""The router's limits over real HTTP, in front of a real engine server: a body past the
replicas' limit gets 413, a prompt the router has no time or room to tokenize 503 with a
reason, and bad token ids or deeply nested JSON 400 on every route that reads a body."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cachetier.kvindex import PrefixIndex
from cachetier.router.app import create_app
from cachetier.router.config import RouterConfig
from cachetier.router.decide import FleetDecider
from cachetier.router.prompt import MAX_JSON_DEPTH
from tests.cachetier.router.conftest import in_given_order
from tests.engine.server.live import EngineServer, post, post_raw
from tests.support import AppThread

BAD_TOKEN_IDS = [-1, 2**32, 2**70]


@pytest.fixture(scope="module")
def indexed_router(replica: EngineServer, router_model_dir: Path) -> Iterator[AppThread]:
    """A router with the CLI's policy and index (so it serves ``/v1/fleet/lookup``)."""
    config = RouterConfig((replica.url,), model=str(router_model_dir), port=0)
    index = PrefixIndex()
    decide = FleetDecider("tier_aware", index)
    router = AppThread(lambda: create_app(config, decide, index=index), name="router")
    router.start_thread()
    yield router
    router.stop()


def nested(depth: int) -> bytes:
    return b'{"prompt": "x", "a": ' + b"[" * depth + b"]" * depth + b"}"


def test_a_body_past_the_replicas_limit_gets_413(indexed_router: AppThread) -> None:
    assert RouterConfig(("http://r:1",)).max_body_bytes == 1 << 20  # the engine server's
    huge = json.dumps({"prompt": "x" * (4 << 20)}).encode()
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/fleet/lookup"):
        status, body = post_raw(indexed_router.url, path, huge)
        assert status == 413 and b"limit" in body, (path, body[:200])


@pytest.mark.parametrize("bad", BAD_TOKEN_IDS)
def test_a_token_id_no_tokenizer_has_gets_400(indexed_router: AppThread, bad: int) -> None:
    prompt = [1, 2, bad, 3]
    for path in ("/v1/completions", "/v1/fleet/lookup"):
        status, body = post(indexed_router.url, path, {"prompt": prompt, "max_tokens": 1})
        assert status == 400 and "token id" in body["error"]["message"], (path, body)


def test_deep_json_gets_400_on_every_route(indexed_router: AppThread) -> None:
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/fleet/lookup"):
        for depth in (MAX_JSON_DEPTH, 2000, 100_000):
            status, body = post_raw(indexed_router.url, path, nested(depth))
            assert status == 400 and b"nests deeper" in body, (path, depth, body[:200])
    # Shallower nesting is the replica's to judge (here: an unknown field, not a 5xx).
    assert post_raw(indexed_router.url, "/v1/completions", nested(8))[0] < 500


@pytest.fixture(scope="module")
def slow_router(replica: EngineServer, smollm2_dir: Path) -> Iterator[AppThread]:
    """SmolLM2's tokenizer with one thread, one place in the queue and 50 ms to tokenize."""
    config = RouterConfig(
        (replica.url,),
        model=str(smollm2_dir),
        port=0,
        num_prepare_threads=1,
        max_queued_prepares=1,
        prepare_timeout_s=0.05,
    )
    router = AppThread(lambda: create_app(config, in_given_order), name="router")
    router.start_thread()
    yield router
    router.stop()


def _until(status_of: Callable[[], int], timeout_s: float = 60) -> int:
    deadline = time.monotonic() + timeout_s
    while (status := status_of()) == 503:
        assert time.monotonic() < deadline, "the router stayed busy"
        time.sleep(0.05)
    return status


def test_a_prompt_past_the_deadline_or_the_queue_gets_503(slow_router: AppThread) -> None:
    # About a MiB of words: far more than 50 ms of tokenizing on any machine.
    text = " ".join(f"word{i % 977}" for i in range(100_000))
    status, body = post(slow_router.url, "/v1/completions", {"prompt": text, "max_tokens": 1})
    assert status == 503 and "took longer than" in body["error"]["message"], body
    # Its tokenizing still holds the only place in the queue: the next request is refused.
    status, body = post(slow_router.url, "/v1/completions", {"prompt": [1, 2], "max_tokens": 1})
    assert status == 503 and "busy" in body["error"]["message"], body
    # Once that work ends the router takes requests again.
    ids = {"prompt": [1, 2, 3], "max_tokens": 1, "temperature": 0}
    assert _until(lambda: post(slow_router.url, "/v1/completions", ids)[0]) == 200
