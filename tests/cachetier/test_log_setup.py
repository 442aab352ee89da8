"""cachetier's lines inside another engine: its handlers, hence its format."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import pytest

from cachetier.util.log_setup import share_handlers


@pytest.fixture
def bare_logging() -> Iterator[None]:
    """The root and ``cachetier`` loggers without handlers, as vLLM leaves them."""
    root, ours = logging.getLogger(), logging.getLogger("cachetier")
    saved = (root.handlers[:], ours.handlers[:], ours.level)
    root.handlers.clear()
    ours.handlers.clear()
    ours.setLevel(logging.NOTSET)
    yield
    root.handlers[:], ours.handlers[:] = saved[0], saved[1]
    ours.setLevel(saved[2])


def test_a_warning_is_formatted_by_the_engines_handler(bare_logging: None) -> None:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("ENGINE %(levelname)s %(name)s: %(message)s"))
    engine = logging.getLogger("some-engine")
    engine.addHandler(handler)
    root = logging.getLogger()
    capture = root.handlers[:]  # pytest's own, added for the test's call: not the host's
    root.handlers.clear()
    try:
        share_handlers("some-engine")
        logging.getLogger("cachetier.store.verify").warning("a record does not match")
        share_handlers("some-engine")  # twice is once
        logging.getLogger("cachetier.store.verify").info("info lines too")
    finally:
        engine.removeHandler(handler)
        root.handlers[:] = capture
    lines = out.getvalue().splitlines()
    assert lines == [
        "ENGINE WARNING cachetier.store.verify: a record does not match",
        "ENGINE INFO cachetier.store.verify: info lines too",
    ]


def test_a_host_that_configured_logging_is_left_alone(bare_logging: None) -> None:
    logging.getLogger().addHandler(logging.NullHandler())
    logging.getLogger("some-engine").addHandler(logging.NullHandler())
    share_handlers("some-engine")
    assert logging.getLogger("cachetier").handlers == []
