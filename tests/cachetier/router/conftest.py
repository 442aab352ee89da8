"""Fixtures of the router tests: real engine servers of the tiny chat model on 127.0.0.1, and a
router in front of them (uvicorn in a thread, port 0)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from cachetier.router.app import Decide, RouteDecision, create_app
from cachetier.router.config import RouterConfig
from cachetier.router.replicas import Replica
from tests.engine.server.live import EngineServer, chat_model, server_config
from tests.support import AppThread


def in_given_order(
    tokens: list[int] | None, session: str | None, up: Sequence[Replica]
) -> RouteDecision:
    """The replicas as configured: what the proxy tests route by (the policies have theirs)."""
    return RouteDecision(list(up))


@pytest.fixture(scope="module")
def router_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return chat_model(tiny_model_dir, tmp_path_factory.mktemp("router-model") / "tiny")


@pytest.fixture(scope="module")
def replica(router_model_dir: Path) -> Iterator[EngineServer]:
    server = EngineServer(server_config(router_model_dir, max_prompt_tokens=400)).start()
    yield server
    server.stop()


@pytest.fixture
def make_router(
    router_model_dir: Path,
) -> Iterator[Callable[..., AppThread]]:
    """Start a router of this test's own in front of ``urls``; stopped afterwards."""
    started: list[AppThread] = []

    def make(urls: Sequence[str], decide: Decide = in_given_order, **settings: Any) -> AppThread:
        config = RouterConfig(tuple(urls), model=str(router_model_dir), port=0, **settings)
        router = AppThread(lambda: create_app(config, decide), name="router")
        router.start_thread()
        started.append(router)
        return router  # its lifespan polled the replicas before it began to serve

    yield make
    for router in started:
        router.stop()
