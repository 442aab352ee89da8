"""The page's only script and its style: sortable tables, the tenant filter, hover tooltips.

Plain JavaScript inline in the page, no library and nothing fetched: the report opens from a
file:// URL with no network. The script reads the page only through ``textContent`` and
attributes and writes only ``textContent``, classes and styles, never HTML, so a hostile tenant
name stays text. The page's Content-Security-Policy allows this script by its hash alone
(``script_csp``): an injected ``<script>`` or ``onerror=`` would not run even if escaping failed.
"""

from __future__ import annotations

import base64
import hashlib

SCRIPT = """
"use strict";
(function () {
  var tip = document.getElementById("tip");
  function markOf(node) {
    return node && node.closest ? node.closest("[data-tip]") : null;
  }
  function place(event) {
    tip.style.left = (event.pageX + 14) + "px";
    tip.style.top = (event.pageY + 14) + "px";
  }
  document.addEventListener("mouseover", function (event) {
    var mark = markOf(event.target);
    if (!mark) { tip.hidden = true; return; }
    tip.textContent = mark.getAttribute("data-tip");
    tip.hidden = false;
    place(event);
  });
  document.addEventListener("mousemove", function (event) {
    if (!tip.hidden) { place(event); }
  });
  document.addEventListener("mouseout", function (event) {
    if (markOf(event.target) && !markOf(event.relatedTarget)) { tip.hidden = true; }
  });

  function cellKey(cell) {
    // data-v holds a number's full value: the text is rounded and has thousands commas.
    var raw = cell.getAttribute("data-v");
    return raw === null ? cell.textContent : Number(raw);
  }
  function compare(a, b) {
    if (typeof a === "number" && typeof b === "number") { return a - b; }
    if (typeof a === "number") { return -1; }
    if (typeof b === "number") { return 1; }
    return String(a).localeCompare(String(b));
  }
  function sortBy(table, header, column) {
    var ascending = header.getAttribute("aria-sort") !== "ascending";
    table.querySelectorAll("th").forEach(function (th) { th.setAttribute("aria-sort", "none"); });
    header.setAttribute("aria-sort", ascending ? "ascending" : "descending");
    var body = table.tBodies[0];
    var rows = Array.prototype.slice.call(body.rows);
    rows.sort(function (r, s) {
      var order = compare(cellKey(r.cells[column]), cellKey(s.cells[column]));
      return ascending ? order : -order;
    });
    rows.forEach(function (row) { body.appendChild(row); });
  }
  document.querySelectorAll("table.sortable").forEach(function (table) {
    table.querySelectorAll("th").forEach(function (header, column) {
      header.addEventListener("click", function () { sortBy(table, header, column); });
      header.addEventListener("keydown", function (event) {
        if (event.key === "Enter" || event.key === " ") {
          event.preventDefault();
          sortBy(table, header, column);
        }
      });
    });
  });

  var filter = document.getElementById("tenant-filter");
  if (filter) {
    filter.addEventListener("change", function () {
      var option = filter.options[filter.selectedIndex];
      var all = option.hasAttribute("data-all");
      var chosen = option.getAttribute("data-choice");
      document.querySelectorAll("[data-tenant], [data-tenants-rest]").forEach(function (node) {
        var keep = all || node.getAttribute("data-tenant") === chosen;
        node.classList.toggle("filtered-out", !keep);
      });
    });
  }
})();
"""

STYLE = """
.plot { max-width: 100%; height: auto; border: 1px solid #eee; display: block; }
.plot .grid { stroke: #e8e8e8; } .plot .axis { stroke: #888; } .plot .x-mark { stroke: #ccc; }
.plot text { font: 11px system-ui, sans-serif; fill: #444; }
.plot .chart-title { font-size: 14px; fill: #222; } .plot .axis-label { font-size: 12px; }
.plot * { pointer-events: none; } .plot .mark { pointer-events: auto; }
.plot .mark:hover { stroke: #222; stroke-width: 1.5; }
th[aria-sort] { cursor: pointer; user-select: none; }
th[aria-sort="ascending"]::after { content: " \\25B2"; }
th[aria-sort="descending"]::after { content: " \\25BC"; }
.filtered-out { display: none; }
.table-scroll { overflow-x: auto; max-width: 100%; }
#tip { position: absolute; background: #222; color: #fff; padding: 3px 7px; font-size: 12px;
       border-radius: 3px; pointer-events: none; max-width: 420px; }
.toolbar { background: #f7f7f7; padding: .4em .8em; position: sticky; top: 0; z-index: 1; }
"""


def script_csp() -> str:
    """The page's Content-Security-Policy: nothing from anywhere, but inline style, ``data:``
    images, and ``SCRIPT`` itself, named by its hash.

    Returns:
        The policy, for a ``<meta http-equiv="Content-Security-Policy">``.
    """
    digest = base64.b64encode(hashlib.sha256(SCRIPT.encode("utf-8")).digest()).decode("ascii")
    return (
        "default-src 'none'; img-src data:; style-src 'unsafe-inline'; "
        f"script-src 'sha256-{digest}'"
    )
