"""Fixtures of the engine server tests: the tiny model with a byte tokenizer, real uvicorn
servers on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.engine.server.live import EngineServer, chat_model, server_config


@pytest.fixture(scope="session")
def chat_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama with a byte-level tokenizer and a chat template."""
    return chat_model(tiny_model_dir, tmp_path_factory.mktemp("chat-model") / "tiny")


@pytest.fixture(scope="module")
def shared_server(chat_model_dir: Path) -> Iterator[EngineServer]:
    """One server for a test module (no tiers; prompts up to 400 tokens)."""
    server = EngineServer(server_config(chat_model_dir, max_prompt_tokens=400)).start()
    yield server
    server.stop()


@pytest.fixture
def make_server(chat_model_dir: Path) -> Iterator[Callable[..., EngineServer]]:
    """Start a server of this test's own (``server_config`` overrides); stopped afterwards."""
    started: list[EngineServer] = []

    def make(model: Path | None = None, **overrides: Any) -> EngineServer:
        server = EngineServer(server_config(model or chat_model_dir, **overrides)).start()
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()
