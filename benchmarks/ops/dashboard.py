"""The dashboard figures of ``benchmarks.ops``: how many of the Grafana dashboard's and the
README's PromQL queries return data from a real Prometheus scraping a live sidecar and engine
server under a little load.

The run is ``tests/deploy/dashboard_stack.py``'s, the one ``tests/deploy/test_dashboard.py``
asserts on: the same stack, load and checker. Needs Debian's ``prometheus`` package.

    python -m benchmarks.ops.dashboard      # prints the figures as one JSON line
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from tests.deploy.dashboard_stack import run_dashboard_check


def measure_dashboard() -> dict[str, Any]:
    """Run the stack, the load and every query once.

    Returns:
        ``dashboard_queries`` and ``dashboard_queries_with_data``, ``readme_queries`` and
        ``readme_queries_with_data``, ``dashboard_structure_problems``, the load's request
        counts, and ``queries_without_data`` (each failing query and why; empty when all
        returned data).
    """
    with tempfile.TemporaryDirectory(prefix="cachetier-dashboard-") as folder:
        report = run_dashboard_check(Path(folder))
    return {**report.figures(), "queries_without_data": report.failures()}


if __name__ == "__main__":
    print(json.dumps(measure_dashboard()))
