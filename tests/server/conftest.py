"""Fixtures of the server tests: real uvicorn servers on 127.0.0.1, real data folders."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cachetier.primitives.keys import Namespace
from cachetier.tiers.remote import RemoteTier, RemoteTierConfig
from tests.server.live import TOKENS, ThreadServer, test_config
from tests.support import SMALL_LAYOUT


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadServer]:
    """One server for a whole test module; tests keep apart by using their own namespaces."""
    server = ThreadServer(test_config(tmp_path_factory.mktemp("shared-server"))).start()
    yield server
    server.stop()


@pytest.fixture
def make_server(tmp_path: Path) -> Iterator[Callable[..., ThreadServer]]:
    """Start a server of this test's own (``test_config`` with overrides); stopped afterwards."""
    started: list[ThreadServer] = []

    def make(**overrides: Any) -> ThreadServer:
        data_dir = Path(overrides.pop("data_dir", tmp_path / f"server{len(started)}"))
        server = ThreadServer(test_config(data_dir, **overrides)).start()
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()


@pytest.fixture
def make_remote() -> Iterator[Callable[..., RemoteTier]]:
    """Build ``RemoteTier``s (with the token of ``token_of``, alice unless told otherwise);
    closed afterwards."""
    opened: list[RemoteTier] = []

    def make(url: str, token_of: str | None = "alice", **config: Any) -> RemoteTier:
        token = None if token_of is None else TOKENS[token_of]
        tier = RemoteTier(RemoteTierConfig(url=url, token=token, **config))
        opened.append(tier)
        return tier

    yield make
    for tier in opened:
        tier.close()


@pytest.fixture
def own_namespace() -> Namespace:
    """A namespace no other test uses (so tests can share a server)."""
    return Namespace(f"model-{uuid.uuid4().hex}", SMALL_LAYOUT)
