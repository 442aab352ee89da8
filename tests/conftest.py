"""Fixtures shared by every test package: real Redis, temp folders, small blocks."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

# Before anything imports Triton (vLLM does, at collection): kernels tests run Triton in its
# interpreter on this CPU-only machine, and Triton reads this when it is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Under pytest-xdist each worker, and every process its tests start, computes on one OpenMP
# thread unless told otherwise: the workers already fill the cores, and OpenMP threads that
# outnumber the free cores spin on each other (an engine's prefill took minutes, not seconds,
# with two workers and another copy of the suite beside them). Set before torch is imported.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

# The plugin below is imported here before pytest_plugins loads it: let pytest rewrite it first.
pytest.register_assert_rewrite("tests.suite_timing")

import redis  # noqa: E402

from cachetier.engine.smollm2 import smollm2_path  # noqa: E402
from cachetier.primitives.keys import Namespace  # noqa: E402
from tests.certs import TLSFiles, make_tls_files  # noqa: E402
from tests.models import make_tiny_llama  # noqa: E402
from tests.suite_timing import heaviest_files_first, slow_tests_without_a_reason  # noqa: E402
from tests.support import SMALL_LAYOUT, own_redis_prefix  # noqa: E402

# Test time per marker after every run (`--durations=25` names the slowest tests); pytester
# runs inner sessions for tests/test_suite_timing.py.
pytest_plugins = ["tests.suite_timing", "pytester"]

REDIS_URL = os.environ.get("CACHETIER_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``cuda`` tests need a CUDA device: without one they are skipped, and reported as
    skipped (``-ra``), never counted as passed. ``make test-gpu`` runs them where one exists.

    Files run heaviest first (``heaviest_files_first``), so that pytest-xdist's workers
    start the long vLLM and model files at once and fill the end with small tests. A ``slow``
    marker without a reason stops the run (``slow_tests_without_a_reason``)."""
    import torch

    if unexplained := slow_tests_without_a_reason(items):
        raise pytest.UsageError(
            "every `slow` marker says why the test must be slow, as "
            f"pytest.mark.slow(reason=...); these do not: {unexplained}"
        )
    items[:] = heaviest_files_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device here; run `make test-gpu` on a GPU machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def redis_url() -> str:
    """The real Redis every machine here runs; a test that needs it fails loudly if it is down."""
    client = redis.Redis.from_url(REDIS_URL, socket_timeout=2)
    try:
        client.ping()
    except redis.exceptions.RedisError as exc:
        pytest.fail(f"Redis at {REDIS_URL} does not answer ({exc}); .ci/run starts one")
    finally:
        client.close()
    return REDIS_URL


@pytest.fixture
def redis_prefix(redis_url: str) -> Iterator[str]:
    """A key prefix of this test's own; every key under it is deleted afterwards."""
    with own_redis_prefix(redis_url, "cachetier-test") as prefix:
        yield prefix


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TLSFiles:
    """A throwaway CA and certificates it signs (``tests.certs``): a server certificate for
    localhost and 127.0.0.1, a client certificate, and one for another host name."""
    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def namespace() -> Namespace:
    return Namespace("test-model", SMALL_LAYOUT)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama (vocab 256, 4 heads, 2 KV heads, head_dim 16), seed 0.

    Shared by the whole session: a test that changes files must copy the folder first.
    """
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), seed=0)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted SmolLM2-135M-Instruct folder (converted on first use, ~30 s, then cached
    under ``$CACHETIER_MODEL_CACHE`` or ``~/.cache/cachetier/models``)."""
    return smollm2_path()
