"""Fixtures of the deploy tests."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def root_logging_kept() -> Iterator[None]:
    """Put the root logger's level back after each test: building vLLM's serve app (the
    manifests' check of ``vllm serve``) sets it to ERROR, and later tests in the same process
    would capture no warnings."""
    root = logging.getLogger()
    level = root.level
    yield
    root.setLevel(level)
