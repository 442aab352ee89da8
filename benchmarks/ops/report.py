"""The report in a real browser, as ``benchmarks.ops`` counts it: ``measure_report_browser()``.

Builds the two reports of ``tests/cachetier/report/realistic.py`` (a slice of the conversation
trace with a live sidecar's counters; an event log whose tenants are named to break the page)
with ``cachetier report`` and opens each in headless Chromium (Debian's ``chromium``) through
the same harness as ``tests/cachetier/report/test_report_browser.py``. Counts are summed over
both pages.

    python -m benchmarks.ops.report [--screenshot docs/images/report-browser.png]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.cachetier.report.browser import inspect_report
from tests.cachetier.report.realistic import (
    HOSTILE_NAME_PLACES,
    HOSTILE_TENANTS,
    realistic_reports,
)


def measure_report_browser(screenshot: Path | None = None) -> dict[str, Any]:
    """Open both realistic reports in headless Chromium and count what went wrong.

    Args:
        screenshot: where to copy the trace report's full-page screenshot (none by default).

    Returns:
        ``report_browser_console_errors`` (console errors, uncaught exceptions and errors the
        browser logged), ``report_browser_failed_loads``, ``report_browser_dialogs``,
        ``report_browser_missing_images``, ``report_browser_empty_plots``,
        ``report_browser_plots``, ``report_interactive_checks`` and
        ``report_interactive_checks_passed`` (sort, tenant filter, hover per page),
        ``report_hostile_names_literal`` (hostile tenant names shown as text where expected:
        table, filter, bar label) of ``report_hostile_names``, ``report_build_s`` and
        ``report_browser_s``; ``report_browser_problems`` lists what failed, if anything.

    Raises:
        BrowserMissingError: no Chromium (the message names the Debian package).
    """
    with tempfile.TemporaryDirectory(prefix="cachetier-ops-report-") as folder:
        start = time.perf_counter()
        # The command's terminal summary goes to stderr: stdout ends with benchmarks.ops's JSON.
        with contextlib.redirect_stdout(sys.stderr):
            reports = realistic_reports(Path(folder))
        build_s = time.perf_counter() - start
        found = {
            name: inspect_report(
                html,
                Path(folder) / f"{name}.png",
                HOSTILE_TENANTS if name == "hostile" else (),
            )
            for name, (html, _) in reports.items()
        }
        if screenshot is not None and found["trace"].screenshot is not None:
            screenshot.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(found["trace"].screenshot, screenshot)
    pages = list(found.values())
    problems = [
        f"{name}: {what}"
        for name, f in found.items()
        for what in (
            *f.console_errors,
            *f.failed_loads,
            *f.dialogs,
            *(f"missing image {m}" for m in f.missing_images),
            *(f"empty plot in {p['section']}: {p['empty']}" for p in f.empty_plots),
            *(f"{check}: {why}" for check, why in f.interactive_failures.items()),
        )
    ]
    return {
        "report_browser_console_errors": sum(len(f.console_errors) for f in pages),
        "report_browser_failed_loads": sum(len(f.failed_loads) for f in pages),
        "report_browser_dialogs": sum(len(f.dialogs) for f in pages),
        "report_browser_missing_images": sum(len(f.missing_images) for f in pages),
        "report_browser_empty_plots": sum(len(f.empty_plots) for f in pages),
        "report_browser_plots": sum(len(f.plots) for f in pages),
        "report_interactive_checks": sum(len(f.interactive) for f in pages),
        "report_interactive_checks_passed": sum(
            1 for f in pages for why in f.interactive.values() if not why
        ),
        "report_hostile_names": len(HOSTILE_TENANTS),
        "report_hostile_names_literal": sum(
            1 for n in found["hostile"].literal.values() if n == HOSTILE_NAME_PLACES
        ),
        "report_build_s": round(build_s, 2),
        "report_browser_s": round(sum(f.elapsed_s for f in pages), 2),
        "report_browser_problems": problems[:20],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--screenshot", type=Path, help="copy the trace report's screenshot here")
    args = parser.parse_args()
    print(json.dumps(measure_report_browser(args.screenshot)))


if __name__ == "__main__":
    main()
