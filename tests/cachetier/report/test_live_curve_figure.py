"""``cachetier report --stats FILE`` with a live curve: its table in the summary, the JSON and
the page, and stats whose curve is missing or malformed (never a traceback, never a value
outside [0, 1] shown as a ratio)."""

from __future__ import annotations

import json
from pathlib import Path

from cachetier.cli.main import main
from cachetier.report.live_curve import live_curve_figure

COUNTERS = {"hits": 3, "misses": 1}


def _stats(curve: object, choices: object = None) -> dict:
    stats: dict = {"tiers": {"cpu": COUNTERS, "disk": COUNTERS}, "live_curve": curve}
    if choices is not None:
        stats["admission"] = {"policy": "adaptive", "tiers": {}, "choices": choices}
    return stats


def _run(tmp_path: Path, stats: dict) -> tuple[int, dict | None, str]:
    source = tmp_path / "stats.json"
    source.write_text(json.dumps(stats))
    out, html = tmp_path / "report.json", tmp_path / "report.html"
    status = main(["report", "--stats", str(source), "--out", str(html), "--json-out", str(out)])
    doc = json.loads(out.read_text()) if status == 0 else None
    return status, doc, html.read_text() if status == 0 else ""


def test_the_curve_is_a_table_of_the_summary_json_and_page(tmp_path: Path, capsys) -> None:
    curve = {
        "cpu": {
            "capacity_blocks": 400,
            "sample_rate": 1.0,
            "num_lookups": 90,
            "hit_ratio": {"0.5": 0.1, "1": 0.25, "2": 0.375, "4": 0.5},
        }
    }
    status, doc, html = _run(tmp_path, _stats(curve, {"disk": "second_hit"}))
    assert status == 0
    figure = doc["figures"]["live_curve"]
    assert figure["rows"] == [["cpu", 400, 1.0, 90, 0.1, 0.25, 0.375, 0.5]]
    assert figure["admission_choices"] == {"disk": "second_hit"}
    printed = capsys.readouterr().out
    assert "cpu              400   0.1000   0.2500   0.3750   0.5000" in printed
    assert "admission now: disk second_hit" in printed
    assert "What more capacity would buy" in html and "0.3750" in html


def test_a_missing_or_malformed_curve_is_left_out_or_blank(tmp_path: Path) -> None:
    assert live_curve_figure({"tiers": {}}, "x") is None
    assert live_curve_figure(_stats("not a mapping"), "x") is None
    assert live_curve_figure(_stats({"cpu": 3, "disk": {"hit_ratio": []}}), "x") is None
    hostile = {
        "<script>": {
            "capacity_blocks": True,
            "sample_rate": "1",
            "num_lookups": 1e400,
            "hit_ratio": {"0.5": 7, "1": -0.5, "2": "0.3", "4": None},
        }
    }
    figure = live_curve_figure(_stats(hostile, ["not", "a", "mapping"]), "x")
    assert figure is not None
    assert figure["rows"] == [["<script>", None, None, None, None, None, None, None]]
    assert figure["admission_choices"] == {}
    status, _, html = _run(tmp_path, _stats(hostile))
    assert status == 0
    assert "<td><script></td>" not in html and "&lt;script&gt;" in html
