"""What ``browser.inspect_report`` runs inside the page: the plots' census, and the interactive
checks (sort by a real click on a header, the tenant filter, a real mouse hover on each SVG
plot's largest mark)."""

from __future__ import annotations

import json
from typing import Any

from tests.cachetier.report.cdp import Browser

PLOTS_JS = """
(() => {
  const out = [];
  for (const plot of document.querySelectorAll(".plot")) {
    const section = plot.closest("section");
    const box = plot.getBoundingClientRect();
    let marks = 0, empty = "";
    if (plot.tagName === "IMG") {
      if (!plot.complete || plot.naturalWidth === 0) {
        empty = "the image did not load";
      } else {
        const canvas = document.createElement("canvas");
        canvas.width = plot.naturalWidth;
        canvas.height = plot.naturalHeight;
        const g = canvas.getContext("2d");
        g.drawImage(plot, 0, 0);
        const px = g.getImageData(0, 0, canvas.width, canvas.height).data;
        for (let i = 0; i < px.length; i += 4) {
          const hi = Math.max(px[i], px[i + 1], px[i + 2]);
          const lo = Math.min(px[i], px[i + 1], px[i + 2]);
          if (hi - lo > 40) { marks += 1; }  // a coloured pixel: data, not axes or text
        }
        if (!marks) { empty = "no coloured pixel: the picture draws no data"; }
      }
    } else {
      marks = Array.from(plot.querySelectorAll(".mark")).filter(m => {
        const b = m.getBBox();
        return b.width > 0 && b.height > 0;
      }).length;
      if (!marks) { empty = "no mark of non-zero size"; }
    }
    if (!empty && (box.width === 0 || box.height === 0)) { empty = "zero size on the page"; }
    out.push({section: section ? section.id : "", kind: plot.tagName.toLowerCase(), marks,
              width: box.width, height: box.height, empty});
  }
  return out;
})()
"""

_CENTRE_JS = """
((el) => {
  el.scrollIntoView({block: "center", inline: "center"});
  const b = el.getBoundingClientRect();
  return [b.left + b.width / 2, b.top + b.height / 2];
})(%s)
"""

_COLUMN_JS = """
((table, column) => Array.from(table.tBodies[0].rows, r => {
  const cell = r.cells[column];
  const raw = cell.getAttribute("data-v");
  return raw === null ? cell.textContent : Number(raw);
}))(document.querySelector(%s), %d)
"""


async def interactive_checks(page: Browser) -> tuple[dict[str, str], list[str]]:
    """Sort, filter and hover, each as a reader would, and what each did.

    Args:
        page: the browser, with a report page loaded.

    Returns:
        Check name -> ``""`` if it passed, else what failed; and the hover texts read.
    """
    results: dict[str, str] = {}
    tips: list[str] = []
    for name, check in (("sort", _check_sort), ("tenant_filter", _check_filter)):
        try:
            results[name] = await check(page)
        except RuntimeError as exc:  # a page too broken for the check is its failure
            results[name] = f"the check could not run: {str(exc)[:300]}"
    try:
        results["hover"], tips = await _check_hover(page)
    except RuntimeError as exc:
        results["hover"] = f"the check could not run: {str(exc)[:300]}"
    return results, tips


async def _centre(page: Browser, selector_js: str) -> tuple[float, float]:
    x, y = await page.evaluate(_CENTRE_JS % selector_js)
    return x, y


async def _click_header(page: Browser, table: str, column: int) -> list[Any]:
    header = f"document.querySelector({json.dumps(table)}).tHead.rows[0].cells[{column}]"
    await page.click(*await _centre(page, header))
    return await page.evaluate(_COLUMN_JS % (json.dumps(table), column))


async def _check_sort(page: Browser) -> str:
    table = "#per_tenant table.sortable"
    if not await page.evaluate(f"!!document.querySelector({json.dumps(table)})"):
        table = "table.sortable"
    if not await page.evaluate(f"!!document.querySelector({json.dumps(table)})"):
        return "no sortable table on the page"
    numeric = await page.evaluate(
        f"Array.from(document.querySelector({json.dumps(table)}).tBodies[0].rows[0].cells)"
        ".findIndex((c, i) => Array.from(document.querySelector("
        f"{json.dumps(table)}).tBodies[0].rows).every(r => r.cells[i].hasAttribute('data-v')))"
    )
    if numeric < 0:
        return f"{table} has no numeric column"
    before = await page.evaluate(_COLUMN_JS % (json.dumps(table), numeric))
    ascending = await _click_header(page, table, numeric)
    if ascending != sorted(before):
        return f"one click on column {numeric} gave {ascending[:8]}, not ascending"
    descending = await _click_header(page, table, numeric)
    if descending != sorted(before, reverse=True):
        return f"a second click on column {numeric} gave {descending[:8]}, not descending"
    if len(set(before)) > 1 and ascending == before and descending == before:
        return "clicking a header did not change the order"
    names = await _click_header(page, table, 0)
    in_order = await page.evaluate(
        "((v) => v.every((s, i) => i === 0 || v[i - 1].localeCompare(s) <= 0))"
        f"({json.dumps(names)})"
    )
    return "" if in_order else f"clicking the first header gave {names[:8]}, not in order"


async def _check_filter(page: Browser) -> str:
    options = await page.evaluate(
        "Array.from(document.querySelectorAll('#tenant-filter option[data-choice]'),"
        " o => o.getAttribute('data-choice'))"
    )
    if len(options) < 2:
        return "no tenant filter with two tenants or more"
    chosen = options[1]
    state = await _choose_tenant(page, 2)
    shown = [t for t, visible in state if visible]
    if not shown or set(shown) != {chosen}:
        return f"choosing {chosen!r} left tenants {sorted(set(shown))[:5]} shown"
    untagged_hidden = await page.evaluate(
        "Array.from(document.querySelectorAll('tr:not([data-tenant])'))"
        ".filter(r => r.getClientRects().length === 0).length"
    )
    if untagged_hidden:
        return f"choosing a tenant hid {untagged_hidden} rows of no tenant"
    state = await _choose_tenant(page, 0)
    if not all(visible for _, visible in state):
        return "choosing all tenants again left some hidden"
    return ""


async def _choose_tenant(page: Browser, index: int) -> list[tuple[str, bool]]:
    """Select option ``index`` as a change of the select does, and every tenant-tagged element's
    tenant and visibility afterwards."""
    pairs = await page.evaluate(
        f"""(() => {{
          const select = document.getElementById("tenant-filter");
          select.selectedIndex = {index};
          select.dispatchEvent(new Event("change", {{bubbles: true}}));
          return Array.from(document.querySelectorAll("[data-tenant], [data-tenants-rest]"),
            e => [e.getAttribute("data-tenant"), e.getClientRects().length > 0]);
        }})()"""
    )
    return [(tenant, visible) for tenant, visible in pairs]


async def _check_hover(page: Browser) -> tuple[str, list[str]]:
    count = await page.evaluate("document.querySelectorAll('svg.plot').length")
    if not count:
        return "no SVG plot to hover", []
    if not await page.evaluate("!!document.getElementById('tip')"):
        return "no tooltip element (#tip) on the page", []
    tips = []
    for i in range(count):
        # The mark with the largest area: a bar of height 0 or a hidden point cannot be hovered.
        mark = f"""Array.from(document.querySelectorAll('svg.plot')[{i}].querySelectorAll('.mark'))
          .map(m => [m, m.getBBox().width * m.getBBox().height])
          .filter(p => p[1] > 0).sort((a, b) => b[1] - a[1]).map(p => p[0])[0]"""
        if not await page.evaluate(f"!!({mark})"):
            return f"SVG plot {i} has no mark to hover", tips
        await page.move_mouse(1, 1)  # off every plot first, so the hover is a new one
        x, y = await _centre(page, mark)
        await page.move_mouse(x, y)
        hidden, text, expected = await page.evaluate(
            f"""(() => {{
              const tip = document.getElementById("tip");
              const under = document.elementFromPoint({x}, {y});
              const mark = under && under.closest("[data-tip]");
              return [tip.hidden, tip.textContent, mark ? mark.getAttribute("data-tip") : null];
            }})()"""
        )
        if hidden or not text or text != expected or not any(c.isdigit() for c in text):
            return (
                f"hovering plot {i} showed {text!r} (hidden {hidden}), expected {expected!r}",
                tips,
            )
        tips.append(text)
    await page.move_mouse(1, 1)
    return "", tips
