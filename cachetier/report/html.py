"""The report as one self-contained HTML page: plots inline (SVG, or PNG as base64), one inline
script, no links out.

The report document itself is embedded too (``<script type="application/json"
id="report-data">``, data only), so the page carries the same figures as the JSON output.
Tables sort by a click on a header, a tenant filter hides the other tenants' rows and bars, and
hovering a bar or point of an SVG plot shows its value (``page_script``, ``svg_figures``).
"""

from __future__ import annotations

import base64
import json
from html import escape
from typing import Any

from cachetier.report.page_script import SCRIPT, STYLE, script_csp
from cachetier.report.plots import DRAWERS, render_png
from cachetier.report.svg_figures import SVG_DRAWERS

_STYLE = """
body { font: 15px/1.45 system-ui, sans-serif; max-width: 980px; margin: 2em auto; color: #222;
       padding: 0 1em; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; }
img { max-width: 100%; border: 1px solid #eee; }
p.how { color: #444; background: #f7f7f7; padding: .6em .8em; border-left: 3px solid #bbb; }
table { border-collapse: collapse; font-size: 13px; margin: .5em 0; }
th, td { border-bottom: 1px solid #e4e4e4; padding: 2px 10px; text-align: right; }
th:first-child, td:first-child { text-align: left; }
.meta { color: #666; font-size: 13px; }
"""


def render_html(doc: dict[str, Any]) -> str:
    """The page for a report document (``build_report``).

    Args:
        doc: the report document.

    Returns:
        The HTML text.
    """
    inp = doc["input"]
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{script_csp()}">',
        f"<title>cachetier report: {escape(str(inp.get('path') or inp.get('stats')))}</title>",
        f"<style>{_STYLE}{STYLE}</style></head><body>",
        "<h1>cachetier hit-rate report</h1>",
        f'<p class="meta">{escape(_describe_input(doc))}</p>',
        _tenant_filter(doc["figures"]),
        "<h2>Headline</h2>",
        _table(["figure", "value"], _headline_rows(doc["headline"]), sortable=False),
    ]
    for name, figure in doc["figures"].items():
        parts.append(f'<section id="{escape(name)}"><h2>{escape(figure["title"])}</h2>')
        if name in SVG_DRAWERS:
            parts.append(SVG_DRAWERS[name](figure))
        elif name in DRAWERS:
            png = base64.b64encode(render_png(name, figure)).decode("ascii")
            parts.append(
                f'<img class="plot" alt="{escape(figure["title"])}" '
                f'src="data:image/png;base64,{png}">'
            )
        parts.append(f'<p class="how">{escape(figure["how"])}</p>')
        table = figure_table(name, figure)
        if table is not None:
            parts.append(_table(*table, tenant_of=_TENANT_OF.get(name)))
        parts.append("</section>")
    parts.append('<div id="tip" role="tooltip" hidden></div>')
    parts.append(f'<script type="application/json" id="report-data">{_json_for_html(doc)}</script>')
    parts.append(f"<script>{SCRIPT}</script>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _json_for_html(doc: dict[str, Any]) -> str:
    # No "<" at all: neither "</script>" nor "<!--" (which would keep a later "</script>" from
    # closing the element) can appear in the data, whatever a tenant is named. JSON reads
    # "\u003c" as "<"; outside strings JSON has no "<", ">" or "&" to replace.
    text = json.dumps(doc, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _tenant_names(figures: dict[str, dict[str, Any]]) -> list[str]:
    names: list[str] = []
    if "per_tenant" in figures:
        names += figures["per_tenant"]["tenants"][:_MAX_TABLE_TENANTS]
    if "tier_counters" in figures:
        names += [str(r[1]) for r in figures["tier_counters"]["rows"] if r[0] == "tenant"]
    return list(dict.fromkeys(names))


def _tenant_filter(figures: dict[str, dict[str, Any]]) -> str:
    names = _tenant_names(figures)
    if len(names) < 2:
        return ""  # nothing to choose between
    options = "".join(
        f'<option data-choice="{escape(n, quote=True)}">{escape(n or "(none)")}</option>'
        for n in names
    )
    return (
        '<p class="toolbar"><label>Tenant: <select id="tenant-filter">'
        f"<option data-all>all tenants</option>{options}</select></label> "
        '<span class="meta">click a column header to sort; hover a bar or point for its value'
        "</span></p>"
    )


# Which column of a figure's table names the tenant a row is about, and whether it applies to
# every row or only to rows whose first cell says "tenant" (the counters table).
_TENANT_OF: dict[str, tuple[int, str | None]] = {
    "per_tenant": (0, None),
    "tier_counters": (1, "tenant"),
}
_MAX_TABLE_TENANTS = 50


def _describe_input(doc: dict[str, Any]) -> str:
    inp = doc["input"]
    what = {"trace": "trace replay of", "events": "event log", "stats": "stats of"}[inp["kind"]]
    text = f"{what} {inp.get('path') or inp.get('stats')}"
    if "num_lookups" in inp:
        text += f", {inp['num_lookups']:,} lookups"
    return f"{text}; generated {doc['generated_at']}, built in {doc['build_s']:.1f} s"


_HEADLINE_LABELS = {
    "num_lookups": "lookups",
    "num_tenants": "tenants",
    "num_tokens": "prompt tokens",
    "hit_tokens": "prompt tokens served from cache",
    "token_hit_ratio": "token hit ratio",
    "hit_tokens_by_source": "served from cache, by tier",
    "saved_s": "prefill seconds saved (estimated)",
    "restore_s": "seconds spent restoring",
    "net_saved_s": "prefill seconds saved, net",
    "alignment_lost_tokens": "tokens lost to block alignment",
    "loaded_tokens": "tokens loaded from tiers",
    "recomputed_by_choice_tokens": "tokens the tiers held, recomputed by choice (cost model)",
    "cost_model_est_saved_s": "seconds saved, the cost model's estimate",
    "block_hit_ratio": "block hit ratio of the modelled store",
    "default_policy": "default eviction policy",
    "ceiling": "block hit ratio of an infinite cache",
    "default_ge_lru_at_every_capacity": "default policy >= LRU at every capacity",
    "num_counter_rows": "rows of counters",
}


def _headline_rows(headline: dict[str, Any]) -> list[list[str]]:
    rows = []
    for key, value in headline.items():
        label = _HEADLINE_LABELS.get(key, key)
        if key == "at_capacity":
            for capacity, ratios in value.items():
                text = ", ".join(f"{n} {r:.4f}" for n, r in ratios.items())
                rows.append([f"block hit ratio at {int(capacity):,} blocks", text])
        elif isinstance(value, dict):
            rows.append([label, ", ".join(f"{k} {_fmt(v)}" for k, v in value.items())])
        else:
            rows.append([label, _fmt(value)])
    return rows


def figure_table(name: str, fig: dict[str, Any]) -> tuple[list[str], list[list[Any]]] | None:
    """The numbers behind a figure as ``(columns, rows)``, ``None`` for a figure without one.

    Args:
        name: the figure's name.
        fig: its dict.

    Returns:
        Column names and rows.
    """
    if name == "capacity_curve":
        names = list(fig["series"])
        rows = [
            [f"{c:,}", *(fig["series"][n][i] for n in names), fig["ceiling"]]
            for i, c in enumerate(fig["capacities"])
        ]
        return ["capacity (blocks)", *names, "infinite"], rows
    if name == "admission":
        names = fig["policies"]
        rows = [
            [
                f"{c:,}",
                *(fig["block_hit_ratio"][n][i] for n in names),
                *(fig["disk_written_vs_all"][n][i] for n in names if n != "all"),
            ]
            for i, c in enumerate(fig["capacities"])
        ]
        written = [f"{n} disk written / all" for n in names if n != "all"]
        return ["disk capacity (blocks)", *(f"{n} hit ratio" for n in names), *written], rows
    if name == "per_tier":
        cols = ["source", "hit tokens", "share of prompt tokens"]
        return cols, [
            list(r) for r in zip(fig["sources"], fig["hit_tokens"], fig["share_of_prompt_tokens"])
        ]
    if name == "per_tenant":
        keys = [
            "num_lookups",
            "num_tokens",
            "hit_tokens",
            "token_hit_ratio",
            "alignment_lost_tokens",
            "net_saved_s",
        ]
        rows = [
            [t, *(fig[k][i] for k in keys)]
            for i, t in enumerate(fig["tenants"][:_MAX_TABLE_TENANTS])
        ]
        return ["tenant", *keys], rows
    if name == "alignment":
        parts = sorted({p for row in fig["breakdown"].values() for p in row})
        rows = [
            [label, *(row.get(p, "") for p in parts)] for label, row in fig["breakdown"].items()
        ]
        return ["prompt tokens", *parts], rows
    if name == "saved":
        keys = ["hit_tokens", "saved_s", "restore_s", "net_saved_s", "prefill_tokens_per_s"]
        return ["figure", "value"], [[k, fig[k]] for k in keys]
    if name == "load_or_recompute":
        keys = [
            "loaded_tokens",
            "recomputed_by_choice_tokens",
            "num_lookups_with_recompute",
            "est_saved_s",
            "verified_by_guard_tokens",
            "num_lookups_verified",
            "quarantined_tokens",
            "num_lookups_quarantined",
        ]
        return ["figure", "value"], [[k, fig[k]] for k in keys]
    if name == "why_missed":
        rows = [
            [c, n, round(share, 4)]
            for c, n, share in zip(fig["causes"], fig["miss_tokens"], fig["share_of_misses"])
        ]
        rows += [["verified", fig["verified_tokens"], ""]]
        rows += [["unexplained", fig["unexplained_tokens"], ""]]
        return ["cause", "tokens", "share of misses"], rows
    if name in ("tier_counters", "live_curve"):
        return fig["columns"], fig["rows"]
    return None


def _table(
    columns: list[str],
    rows: list[list[Any]],
    *,
    sortable: bool = True,
    tenant_of: tuple[int, str | None] | None = None,
) -> str:
    head = "".join(
        f'<th tabindex="0" aria-sort="none">{escape(str(c))}</th>'
        if sortable
        else f"<th>{escape(str(c))}</th>"
        for c in columns
    )
    body = []
    for row in rows:
        who = ""
        if tenant_of is not None and (tenant_of[1] is None or row[0] == tenant_of[1]):
            who = f' data-tenant="{escape(str(row[tenant_of[0]]), quote=True)}"'
        cells = "".join(
            _cell(v, tenant_of is not None and i == tenant_of[0]) for i, v in enumerate(row)
        )
        body.append(f"<tr{who}>{cells}</tr>")
    kind = ' class="sortable"' if sortable else ""
    # A wide table (the counters) scrolls inside the page instead of widening it.
    return (
        f'<div class="table-scroll"><table{kind}><thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(body)}</tbody></table></div>"
    )


def _cell(value: Any, is_tenant: bool) -> str:
    if is_tenant and value == "":
        return "<td>(none)</td>"
    # A number keeps its full value for sorting; its text is rounded, with commas.
    sort_key = (
        f' data-v="{value!r}"'
        if isinstance(value, (int, float)) and not isinstance(value, bool)
        else ""
    )
    return f"<td{sort_key}>{escape(_fmt(value))}</td>"


def _fmt(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 10 else f"{value:,.1f}"
    return str(value)
