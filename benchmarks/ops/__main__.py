"""What an operator needs, measured in one run (issue 19): the server-only install, the
dashboard against a real Prometheus, the report in a real browser, and pinned prefixes.

    python -m benchmarks.ops --json

Each part is the same harness its test uses:

- ``server_only_env_mib`` / ``server_only_env_has_torch``: ``pip install cachetier[server]``
  from a wheel of this checkout in a fresh venv (``benchmarks.ops.install``;
  ``tests/deploy/test_server_install.py``).
- ``dashboard_queries_with_data`` / ``dashboard_queries``: Debian's ``prometheus`` scraping a
  live sidecar and engine server under a little load, every query of
  ``deploy/grafana/dashboards/cachetier.json`` and of the README evaluated through its HTTP API
  (``benchmarks.ops.dashboard``; ``tests/deploy/test_dashboard.py``).
- ``report_browser_console_errors``: ``cachetier report``'s pages in headless Chromium
  (``benchmarks.ops.report``; ``tests/cachetier/report/test_report_browser.py``).
- ``pinned_blocks_restored_after_flood`` / ``pinned_blocks``: a pinned chain on a live sidecar
  flooded with 4x its capacity and restarted (``benchmarks.ops.pins``;
  ``tests/server/test_pins_server.py``); ``redis_pinned_*`` the same with a Redis tier behind
  it, read back by a second sidecar whose CPU and disk tiers are empty.

Targets: ``server_only_env_has_torch`` false, the two pairs equal, no console errors. Needs
Redis on 127.0.0.1:6379, Debian's ``prometheus`` and ``chromium``, and pip's package index.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from benchmarks.ops.dashboard import measure_dashboard
from benchmarks.ops.install import measure_server_env
from benchmarks.ops.pins import measure_pins, measure_redis_pins
from benchmarks.ops.report import measure_report_browser
from benchmarks.support.output import emit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result: dict[str, Any] = {}
    seconds: dict[str, float] = {}
    for name, measure in (
        ("install", measure_server_env),
        ("dashboard", measure_dashboard),
        ("report", measure_report_browser),
        ("pins", measure_pins),
    ):
        start = time.perf_counter()
        result.update(measure())
        seconds[name] = round(time.perf_counter() - start, 1)
    # The same flood with a Redis tier behind the sidecar, read back by a second pod with empty
    # CPU and disk tiers: the chain must come from Redis's pins.
    start = time.perf_counter()
    redis = measure_redis_pins()
    seconds["redis_pins"] = round(time.perf_counter() - start, 1)
    result["redis_pinned_blocks"] = redis["pinned_blocks"]
    result["redis_pinned_blocks_restored_after_flood"] = redis["pinned_blocks_restored_after_flood"]
    result["redis_unpinned_blocks_restored_after_flood"] = redis[
        "unpinned_blocks_restored_after_flood"
    ]
    result["seconds"] = seconds
    result["targets_met"] = (
        result["server_only_env_has_torch"] is False
        and result["dashboard_queries_with_data"] == result["dashboard_queries"]
        and result["report_browser_console_errors"] == 0
        and result["pinned_blocks_restored_after_flood"] == result["pinned_blocks"]
        and result["redis_pinned_blocks_restored_after_flood"] == result["redis_pinned_blocks"]
    )
    emit(result, args.json)


if __name__ == "__main__":
    main()
