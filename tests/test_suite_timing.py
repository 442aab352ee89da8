"""The suite's own budget tools (``tests/suite_timing.py``): the order files run in, the time
per marker every run prints, and the refusal of a ``slow`` marker that does not say why."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.suite_timing import (
    FAST_TEST_S,
    estimated_cost_s,
    heaviest_files_first,
    recorded_file_seconds,
)

INNER_CONFTEST = 'pytest_plugins = ["tests.suite_timing"]\n'


@dataclass
class Collected:
    """What ``heaviest_files_first`` reads of a collected test: its id and its keywords."""

    nodeid: str
    keywords: dict[str, int] = field(default_factory=dict)


def _items(*specs: tuple[str, tuple[str, ...]]) -> list[Collected]:
    return [Collected(nodeid, dict.fromkeys(marks, 1)) for nodeid, marks in specs]


def test_a_test_costs_what_its_heaviest_marker_says() -> None:
    assert estimated_cost_s(Collected("a.py::t", {"vllm": 1, "model": 1, "slow": 1})) == 30.0
    assert estimated_cost_s(Collected("a.py::t", {"faults": 1})) == 2.0
    assert estimated_cost_s(Collected("a.py::t")) == FAST_TEST_S
    assert estimated_cost_s(Collected("a.py::t", {"cuda": 1, "slow": 1})) == 0.0  # skipped


def test_files_run_heaviest_first_and_keep_their_own_order() -> None:
    items = _items(
        ("tests/a.py::one", ()),
        ("tests/b.py::one", ("model",)),
        ("tests/a.py::two", ()),
        ("tests/c.py::one", ("slow",)),
        ("tests/b.py::two", ()),
    )
    ordered = [i.nodeid for i in heaviest_files_first(items, recorded={})]
    assert ordered == [
        "tests/b.py::one",
        "tests/b.py::two",
        "tests/c.py::one",
        "tests/a.py::one",
        "tests/a.py::two",
    ]


def test_recorded_seconds_outrank_the_estimates() -> None:
    items = _items(("tests/a.py::one", ()), ("tests/b.py::one", ("model",)))
    ordered = heaviest_files_first(items, recorded={"tests/a.py": 100.0})
    assert [i.nodeid for i in ordered] == ["tests/a.py::one", "tests/b.py::one"]


def test_an_unreadable_record_is_no_record(tmp_path: Path) -> None:
    assert recorded_file_seconds(tmp_path / "missing.json") == {}
    (tmp_path / "bad.json").write_text("{not json")
    assert recorded_file_seconds(tmp_path / "bad.json") == {}
    (tmp_path / "list.json").write_text("[1, 2]")
    assert recorded_file_seconds(tmp_path / "list.json") == {}
    (tmp_path / "mixed.json").write_text('{"a.py": 2.5, "b.py": "x"}')
    assert recorded_file_seconds(tmp_path / "mixed.json") == {"a.py": 2.5}


def test_every_run_prints_test_time_per_marker_and_records_files(
    pytester: pytest.Pytester,
) -> None:
    pytester.makeconftest(INNER_CONFTEST)
    pytester.makeini("[pytest]\nmarkers =\n    slow: slow\n    model: model\n")
    pytester.makepyfile(
        test_inner="""
        import pytest

        @pytest.mark.slow(reason="a stand-in")
        def test_slow():
            pass

        def test_fast():
            pass
        """
    )
    out = pytester.path / "durations.json"
    result = pytester.runpytest("-p", "no:cacheprovider", "--file-durations-out", str(out))
    result.assert_outcomes(passed=2)
    result.stdout.re_match_lines(
        [r".*test time per marker.*", r"slow\s+1\s+\d", r"fast set \(none of these\)\s+1\s+\d"]
    )
    assert set(json.loads(out.read_text())) == {"test_inner.py"}


def test_a_slow_marker_without_a_reason_stops_the_run(pytester: pytest.Pytester) -> None:
    # The repository's own collection hook, as tests/conftest.py runs it.
    pytester.makeconftest(
        INNER_CONFTEST
        + "from tests.suite_timing import slow_tests_without_a_reason\n"
        + "import pytest\n"
        + "def pytest_collection_modifyitems(items):\n"
        + "    if bad := slow_tests_without_a_reason(items):\n"
        + "        raise pytest.UsageError(f'no reason: {bad}')\n"
    )
    pytester.makeini("[pytest]\nmarkers =\n    slow: slow\n")
    pytester.makepyfile(
        test_inner="""
        import pytest

        @pytest.mark.slow
        def test_unexplained():
            pass

        @pytest.mark.slow(reason="  ")
        def test_blank():
            pass

        @pytest.mark.slow(reason="starts a process")
        def test_explained():
            pass
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*no reason*test_unexplained*test_blank*"])
    assert "test_explained" not in result.stderr.str()
