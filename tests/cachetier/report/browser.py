"""A report page opened in real headless Chromium: what went wrong there, and whether its
interactive parts work (``inspect_report``). The test and ``benchmarks/ops/report.py`` share it.

What counts as wrong: a console error (``console.error``, an error the browser logs such as a
refused or failed load or a CSP violation, an uncaught exception), a failed load, an alert
dialog, an ``<img>`` that did not load, and an empty plot (an SVG plot with no mark of non-zero
size; a PNG plot with no coloured pixel: matplotlib draws axes and text in greys, data in
colours).
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.cachetier.report.cdp import Browser
from tests.cachetier.report.page_checks import PLOTS_JS, interactive_checks

ERROR_CONSOLE_TYPES = ("error", "assert")


@dataclass
class PageFindings:
    """What one report page did in the browser.

    ``plots`` is one dict per plot (section, kind, marks, size, ``empty``: why it is empty, or
    ``""``); ``interactive`` maps a check's name to ``""`` when it passed, else what failed;
    ``literal`` maps each text asked for to how many elements show exactly it.
    """

    console_errors: list[str] = field(default_factory=list)
    failed_loads: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)
    missing_images: list[str] = field(default_factory=list)
    plots: list[dict[str, Any]] = field(default_factory=list)
    interactive: dict[str, str] = field(default_factory=dict)
    tooltips: list[str] = field(default_factory=list)
    literal: dict[str, int] = field(default_factory=dict)
    num_scripts: int = 0
    screenshot: Path | None = None
    elapsed_s: float = 0.0

    @property
    def empty_plots(self) -> list[dict[str, Any]]:
        """The plots that draw nothing."""
        return [p for p in self.plots if p["empty"]]

    @property
    def interactive_failures(self) -> dict[str, str]:
        """The interactive checks that failed, with what failed."""
        return {name: why for name, why in self.interactive.items() if why}


def inspect_report(
    html: Path, screenshot: Path, literal_texts: tuple[str, ...] = ()
) -> PageFindings:
    """Open a report page in headless Chromium, screenshot it and try its interactive parts.

    Args:
        html: the page.
        screenshot: where the full-page PNG goes (taken before anything is clicked).
        literal_texts: texts (hostile tenant names) the page must show as text.

    Returns:
        The findings.

    Raises:
        BrowserMissingError: no Chromium (the message names the Debian package).
    """
    return asyncio.run(_inspect(html, screenshot, literal_texts))


async def _inspect(html: Path, screenshot: Path, literal_texts: tuple[str, ...]) -> PageFindings:
    start = time.perf_counter()
    found = PageFindings()
    async with Browser() as page:
        for domain in ("Runtime", "Log", "Page", "Network"):
            await page.send(f"{domain}.enable")
        await page.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": page.width, "height": page.height, "deviceScaleFactor": 1, "mobile": False},
        )
        loaded = page.expect("Page.loadEventFired")
        navigated = await page.send("Page.navigate", {"url": html.resolve().as_uri()})
        if navigated.get("errorText"):
            found.failed_loads.append(f"{html}: {navigated['errorText']}")
            return found
        await asyncio.wait_for(loaded, 60)
        await page.evaluate(
            "Promise.all(Array.from(document.images, i => i.decode().catch(() => null)))"
            ".then(() => true)"
        )
        found.missing_images = await page.evaluate(
            "Array.from(document.images).filter(i => !i.complete || i.naturalWidth === 0)"
            ".map(i => (i.alt || '') + ' ' + i.src.slice(0, 80))"
        )
        found.plots = await page.evaluate(PLOTS_JS)
        await _screenshot(page, screenshot)
        found.screenshot = screenshot
        found.interactive, found.tooltips = await interactive_checks(page)
        for text in literal_texts:
            found.literal[text] = await page.evaluate(
                f"Array.from(document.querySelectorAll('td, option, text'))"
                f".filter(e => e.textContent === {_js_string(text)}).length"
            )
        found.num_scripts = await page.evaluate("document.scripts.length")
        await asyncio.sleep(0.2)  # an error logged by the last interaction arrives after it
        _collect_errors(page.events, found)
    found.elapsed_s = time.perf_counter() - start
    return found


def _js_string(text: str) -> str:
    return json.dumps(text)  # a JSON string is a JavaScript string literal


async def _screenshot(page: Browser, path: Path) -> None:
    metrics = await page.send("Page.getLayoutMetrics")
    size = metrics["cssContentSize"]
    shot = await page.send(
        "Page.captureScreenshot",
        {
            "format": "png",
            "captureBeyondViewport": True,
            "clip": {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1},
        },
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(base64.b64decode(shot["data"]))


def _collect_errors(events: list[tuple[str, dict[str, Any]]], found: PageFindings) -> None:
    urls: dict[str, str] = {}
    for method, params in events:
        if method == "Network.requestWillBeSent":
            urls[params["requestId"]] = params["request"]["url"][:120]
        elif method == "Network.loadingFailed":
            url = urls.get(params["requestId"], params["requestId"])
            found.failed_loads.append(f"{url}: {params.get('errorText', '')}")
        elif method == "Network.responseReceived" and params["response"].get("status", 0) >= 400:
            found.failed_loads.append(
                f"{params['response']['url'][:120]}: HTTP {params['response']['status']}"
            )
        elif method == "Runtime.consoleAPICalled" and params["type"] in ERROR_CONSOLE_TYPES:
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in params["args"])
            found.console_errors.append(f"console.{params['type']}: {text}")
        elif method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            what = details.get("exception", {}).get("description") or details.get("text", "")
            found.console_errors.append(f"uncaught: {what}")
        elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
            entry = params["entry"]
            found.console_errors.append(f"{entry.get('source', 'log')}: {entry['text']}")
        elif method == "Page.javascriptDialogOpening":
            found.dialogs.append(f"{params['type']}: {params['message']}")
