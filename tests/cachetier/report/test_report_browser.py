"""``cachetier report``'s page in real headless Chromium (Debian's ``chromium``): no console
error, no missing image, no empty plot; sorting, the tenant filter and hovering work; hostile
tenant names stay text. A missing Chromium fails, naming the package.

``CACHETIER_REGENERATE_DOCS=1`` also copies the trace report's screenshot to
``docs/images/report-browser.png`` (the README's picture of the report).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.cachetier.report.browser import PageFindings, inspect_report
from tests.cachetier.report.cdp import BrowserMissingError
from tests.cachetier.report.realistic import (
    HOSTILE_NAME_PLACES,
    HOSTILE_TENANTS,
    realistic_reports,
)

pytestmark = pytest.mark.slow(
    reason="builds realistic reports and drives them in headless Chromium"
)

ROOT = Path(__file__).resolve().parents[3]
DOCS_SCREENSHOT = ROOT / "docs" / "images" / "report-browser.png"
REGENERATE_ENV = "CACHETIER_REGENERATE_DOCS"


def _inspect(html: Path, screenshot: Path, literal: tuple[str, ...] = ()) -> PageFindings:
    try:
        return inspect_report(html, screenshot, literal)
    except BrowserMissingError as exc:
        pytest.fail(str(exc))


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict]]:
    return realistic_reports(tmp_path_factory.mktemp("reports"))


def _assert_clean(found: PageFindings, doc: dict) -> None:
    assert found.console_errors == []
    assert found.failed_loads == []
    assert found.dialogs == []
    assert found.missing_images == []
    assert found.empty_plots == []
    drawn = {"hit_rate_over_time", "per_tier", "per_tenant", "saved", "alignment"}
    drawn |= {"capacity_curve"} if "capacity_curve" in doc["figures"] else set()
    assert sorted(p["section"] for p in found.plots) == sorted(drawn & set(doc["figures"]))
    assert found.interactive_failures == {}
    assert set(found.interactive) == {"sort", "tenant_filter", "hover"}


def _tip_of_largest_tenant(doc: dict) -> str:
    tenants = doc["figures"]["per_tenant"]
    i = max(range(len(tenants["tenants"])), key=lambda j: tenants["token_hit_ratio"][j] or 0)
    name = tenants["tenants"][i] or "(none)"
    return f"{name}: token hit ratio {tenants['token_hit_ratio'][i]:.1%}"


def test_the_trace_report_in_a_browser(
    reports: dict[str, tuple[Path, dict]], tmp_path: Path
) -> None:
    html, doc = reports["trace"]
    found = _inspect(html, tmp_path / "report-browser.png")
    _assert_clean(found, doc)
    assert {p["kind"] for p in found.plots} == {"img", "svg"}
    # Hovering shows the figures' own values: the tallest tenant bar, the per-tier share.
    assert any(t.startswith(_tip_of_largest_tenant(doc)) for t in found.tooltips), found.tooltips
    tier = doc["figures"]["per_tier"]
    best = max(range(len(tier["sources"])), key=lambda j: tier["share_of_prompt_tokens"][j])
    share = f"{tier['sources'][best]}: {tier['share_of_prompt_tokens'][best]:.1%} of prompt"
    assert any(t.startswith(share) for t in found.tooltips), found.tooltips
    assert any(" blocks: block hit ratio 0." in t for t in found.tooltips), found.tooltips
    assert found.screenshot is not None
    shot = found.screenshot.read_bytes()
    assert shot.startswith(b"\x89PNG\r\n\x1a\n") and len(shot) > 50_000
    if os.environ.get(REGENERATE_ENV):
        DOCS_SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(found.screenshot, DOCS_SCREENSHOT)


def test_hostile_tenant_names_stay_text(
    reports: dict[str, tuple[Path, dict]], tmp_path: Path
) -> None:
    html, doc = reports["hostile"]
    assert set(HOSTILE_TENANTS) <= set(doc["figures"]["per_tenant"]["tenants"])
    found = _inspect(html, tmp_path / "hostile.png", HOSTILE_TENANTS)
    _assert_clean(found, doc)
    assert found.num_scripts == 2  # the data block and the page's own script, nothing injected
    # Each name shows as itself: in its table row, its filter option and under its bar.
    assert found.literal == {name: HOSTILE_NAME_PLACES for name in HOSTILE_TENANTS}
    assert any(t.startswith(_tip_of_largest_tenant(doc)) for t in found.tooltips), found.tooltips


def test_the_harness_sees_what_breaks_a_page(tmp_path: Path) -> None:
    """The checks above can fail: a page with each fault is caught for each."""
    page = tmp_path / "broken.html"
    page.write_text(
        "<!doctype html><html><body>"
        '<section id="a"><img class="plot" alt="gone" src="missing.png"></section>'
        '<section id="b"><svg class="plot" width="300" height="100"><rect class="mark" '
        'width="0" height="0"/></svg></section>'
        "<script>console.error('drawn badly'); alert('hi'); undefinedFunction();</script>"
        "</body></html>"
    )
    found = _inspect(page, tmp_path / "broken.png")
    assert any("drawn badly" in e for e in found.console_errors), found.console_errors
    assert any("undefinedFunction" in e for e in found.console_errors), found.console_errors
    assert any("missing.png" in f for f in found.failed_loads), found.failed_loads
    assert found.dialogs == ["alert: hi"]
    assert len(found.missing_images) == 1
    assert [p["section"] for p in found.empty_plots] == ["a", "b"]
    assert found.interactive_failures == {
        "sort": "no sortable table on the page",
        "tenant_filter": "no tenant filter with two tenants or more",
        "hover": "no tooltip element (#tip) on the page",
    }


def test_no_chromium_fails_naming_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.cachetier.report.cdp import find_chromium

    monkeypatch.setenv("PATH", "")
    monkeypatch.delenv("CACHETIER_CHROMIUM", raising=False)
    with pytest.raises(BrowserMissingError, match="Debian's `chromium` package"):
        find_chromium()
