"""The page's text, without a browser: hostile names escaped everywhere, the script allowed by
its hash and by nothing else, round y axes (``test_report_browser`` opens the page itself)."""

from __future__ import annotations

import base64
import hashlib
import json
import re

import pytest

from cachetier.report.build import headline
from cachetier.report.events import LookupEvent
from cachetier.report.figures import lookup_figures
from cachetier.report.html import render_html
from cachetier.report.page_script import SCRIPT
from cachetier.report.svg import Bar, bar_chart, nice_top

HOSTILE = ("<script>alert(1)</script>", '<img src=x onerror="alert(2)">', "<!--<script>", "a&b")


def _doc() -> dict:
    events = [
        LookupEvent(100.0 + i, name, 1000, {"cpu": 160 * (i % 3)}, 16)
        for i, name in enumerate([*HOSTILE, "alice", ""] * 3)
    ]
    figures = lookup_figures(events, prefill_tokens_per_s=100.0, prefill_source="a test")
    return {
        "input": {"kind": "events", "path": "<b>events</b>.jsonl", "num_lookups": len(events)},
        "generated_at": "now",
        "build_s": 0.1,
        "headline": headline(figures),
        "figures": figures,
        "timings_s": {},
    }


def test_hostile_names_never_reach_the_page_as_markup() -> None:
    page = render_html(_doc())
    for name in HOSTILE[:3]:
        assert name not in page
    assert "<b>events</b>" not in page
    # Two script elements: the data block and the page's own script.
    assert len(re.findall(r"<script\b", page)) == 2
    data = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', page)
    assert data and "<" not in data.group(1)
    assert set(HOSTILE) <= set(json.loads(data.group(1))["figures"]["per_tenant"]["tenants"])


def test_the_policy_allows_the_script_by_its_hash_alone() -> None:
    page = render_html(_doc())
    digest = base64.b64encode(hashlib.sha256(SCRIPT.encode()).digest()).decode()
    policy = re.search(r'http-equiv="Content-Security-Policy" content="([^"]*)"', page)
    assert policy and f"script-src 'sha256-{digest}'" in policy.group(1)
    assert "unsafe-inline" not in policy.group(1).split("script-src")[1]
    assert f"<script>{SCRIPT}</script>" in page


def test_tables_carry_sort_keys_and_tenants() -> None:
    page = render_html(_doc())
    assert '<table class="sortable">' in page
    assert 'data-tenant="&lt;script&gt;alert(1)&lt;/script&gt;"' in page
    assert 'data-tenant=""' in page and "<td>(none)</td>" in page
    assert re.search(r'<td data-v="3">3</td>', page)


@pytest.mark.parametrize(
    "largest,top,steps",
    [(0.05, 0.05, 5), (0.3, 0.3, 6), (0.36, 0.4, 4), (1.0, 1.0, 5), (7, 8, 4), (0.0363, 0.04, 4)],
)
def test_nice_top(largest: float, top: float, steps: int) -> None:
    assert nice_top(largest) == (pytest.approx(top), steps)


def test_a_bar_chart_escapes_labels_and_tips() -> None:
    svg = bar_chart(
        [Bar(HOSTILE[0], 0.5, HOSTILE[1], "#123456", tenant=HOSTILE[2])],
        title="t<",
        y_label="y",
        y_max=1.0,
        y_format=str,
    )
    assert "<script>" not in svg and "<img" not in svg and "<!--" not in svg
    assert 'data-tip="&lt;img src=x onerror=&quot;alert(2)&quot;&gt;"' in svg
    with pytest.raises(ValueError, match="at least one bar"):
        bar_chart([], title="t", y_label="y", y_max=1.0, y_format=str)
