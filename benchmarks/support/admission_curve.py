"""The report's sampled curve against its exact replay, and the report's own wall time.

``sampled_vs_exact`` replays one trace as ``cachetier report --trace`` does, once on its
default hashed sample of keys and once with ``--exact``, and compares every point: each
eviction policy's (and Belady's) block hit ratio at each curve capacity and each admission
policy's at each disk capacity. ``time_report`` times the default report of a trace file,
from reading it to the HTML page.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from cachetier.report.build import build_report
from cachetier.report.config import ReportConfig
from cachetier.report.hierarchy_replay import replay_for_report
from cachetier.report.html import render_html
from cachetier.report.replay import ReplayTrace


def sampled_vs_exact(trace: ReplayTrace, cpu_blocks: int) -> dict[str, Any]:
    """Every point of the report's curve and admission figure, sampled and exact.

    Args:
        trace: the keyed trace.
        cpu_blocks: the modelled CPU tier, in blocks (the report's other settings default).

    Returns:
        ``sample_rate``, ``max_abs_error`` over every point, the point it was at
        (``worst``), and each series' largest error (``per_series``).
    """
    config = ReportConfig(trace="<benchmark>", cpu_blocks=cpu_blocks, quiet=True)
    sampled = replay_for_report(trace, config)
    exact = replay_for_report(trace, dataclasses.replace(config, exact=True))
    per_series: dict[str, float] = {}
    worst: tuple[float, str, int] = (0.0, "", 0)
    pairs = [
        (f"curve:{name}", points, exact.curve[name], config.curve_capacities)
        for name, points in sampled.curve.items()
    ] + [
        (f"admission:{name}", runs, exact.admission[name], sampled.admission_capacities)
        for name, runs in sampled.admission.items()
    ]
    for series, got, want, capacities in pairs:
        errors = [abs(g.block_hit_ratio - w.block_hit_ratio) for g, w in zip(got, want)]
        per_series[series] = round(max(errors), 5)
        for error, capacity in zip(errors, capacities):
            worst = max(worst, (error, series, capacity))
    return {
        "sample_rate": sampled.sample_rate,
        "max_abs_error": round(worst[0], 5),
        "worst": {"series": worst[1], "capacity_blocks": worst[2]},
        "per_series": per_series,
    }


def time_report(path: Path) -> float:
    """Seconds of the default report of the trace at ``path``: read, replay, figures, page."""
    start = time.perf_counter()
    render_html(build_report(ReportConfig(trace=str(path), quiet=True)))
    return time.perf_counter() - start
