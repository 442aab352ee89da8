"""Fixtures of the fault tests, and the figures they report.

Each fault test adds what it saw to ``fault_figures`` (rounds run, blocks lost, corrupt blocks
served, fuzz inputs, ...). With ``CACHETIER_FAULTS_REPORT=<file>`` set, the session writes the
totals there as JSON; ``benchmarks/faults.py`` runs this suite that way and prints them.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator

import pytest

from tests.faults.fuzzing import Tally

REPORT_ENV = "CACHETIER_FAULTS_REPORT"


class FaultFigures:
    """Counters summed over the session, and gauges (last value wins), thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.values: dict[str, float] = {}

    def add(self, name: str, amount: float = 1) -> None:
        with self._lock:
            self.values[name] = self.values.get(name, 0) + amount

    def set(self, name: str, value: float) -> None:
        with self._lock:
            self.values[name] = value


@pytest.fixture(scope="session")
def fault_figures() -> Iterator[FaultFigures]:
    figures = FaultFigures()
    yield figures
    path = os.environ.get(REPORT_ENV)
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(figures.values, f, indent=2, sort_keys=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Every test here injects a real fault: all carry the marker `make test-fast` leaves out.
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.path).startswith(here):
            item.add_marker(pytest.mark.faults)


@pytest.fixture
def tally(fault_figures: FaultFigures) -> Iterator[Tally]:
    """A fuzz test's count of inputs and crashes, added to the figures when it ends."""
    found = Tally()
    yield found
    fault_figures.add("fuzz_inputs", found.num_inputs)
    fault_figures.add("fuzz_crashes", len(found.crashes))
