"""Reading a report's inputs: what is forgiven, what is refused, and how it is named."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from cachetier.report.events import EventLog, LookupEvent
from cachetier.report.inputs import load_events, load_stats

GOOD = LookupEvent(10.0, "a", 100, {"cpu": 32}, 16, 4, 0.01)


def test_an_event_log_cut_mid_line_loses_only_that_line(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    with EventLog(path) as log:
        log.record(GOOD)
        log.record(GOOD)
    with open(path, "a") as f:
        f.write('{"time_s": 12.5, "ten')
    assert load_events(str(path)) == [GOOD, GOOD]


def test_a_bad_line_before_the_end_is_named(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text(f"{GOOD.to_json()}\nnot an event\n{GOOD.to_json()}\n")
    with pytest.raises(ValueError, match=r"events.jsonl:2: not a lookup event"):
        load_events(str(path))


@pytest.mark.parametrize(
    "change",
    [
        {"time_s": math.nan},
        {"time_s": math.inf},
        {"restore_s": -1.0},
        {"restore_s": math.nan},
        {"num_alignment_lost_tokens": -3},
    ],
)
def test_events_that_would_skew_a_report_are_refused(tmp_path: Path, change: dict) -> None:
    fields = {"time_s": 1.0, "tenant": "", "num_tokens": 10}
    with pytest.raises(ValueError):
        LookupEvent(**{**fields, **change})
    # The same values read from a log (JSON writes NaN as NaN) name the line.
    raw = json.loads(GOOD.to_json())
    raw.update(change)
    path = tmp_path / "events.jsonl"
    path.write_text(f"{GOOD.to_json()}\n{json.dumps(raw)}\n{GOOD.to_json()}\n")
    with pytest.raises(ValueError, match=r"events.jsonl:2: "):
        load_events(str(path))


def test_stats_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "stats.json"
    path.write_text(json.dumps({"tiers": {"cpu": {"hits": 1, "misses": 2}}}))
    assert load_stats(str(path)) == {"tiers": {"cpu": {"hits": 1, "misses": 2}}}
    path.write_text("{")
    with pytest.raises(ValueError, match="stats are not valid JSON"):
        load_stats(str(path))
