"""The figures the page draws as inline SVG (``svg``) rather than as a PNG: the ones a reader
wants to read values off, per tenant, per tier and along the capacity curve.

``render_composite`` (``--png-out``) still draws them with matplotlib, as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cachetier.report.figures import MAX_TENANTS_PLOTTED
from cachetier.report.plots import COLORS
from cachetier.report.svg import Bar, Series, bar_chart, log_line_chart


def _percent(value: float) -> str:
    return f"{value:.0%}" if round(value * 100, 6).is_integer() else f"{value:.1%}"


def _ratio_top(largest: float) -> float:
    """A y axis top for ratios: a little above the largest, at most 100%."""
    return min(1.0, max(largest * 1.1, 0.05))


def svg_per_tenant(fig: dict[str, Any]) -> str:
    """Token hit ratio per tenant, largest first, the tail past ``MAX_TENANTS_PLOTTED`` as one bar.

    Args:
        fig: the ``per_tenant`` figure.

    Returns:
        The ``<svg>`` element.
    """
    rows = list(zip(fig["tenants"], fig["num_lookups"], fig["num_tokens"], fig["hit_tokens"]))
    bars = []
    keep = rows if len(rows) <= MAX_TENANTS_PLOTTED else rows[: MAX_TENANTS_PLOTTED - 1]
    for tenant, lookups, tokens, hits in keep:
        value = hits / tokens if tokens else 0.0
        name = tenant or "(none)"
        tip = (
            f"{name}: token hit ratio {value:.1%} "
            f"({hits:,} of {tokens:,} tokens, {lookups:,} lookups)"
        )
        bars.append(Bar(name, value, tip, COLORS["cpu"], tenant=tenant))
    if len(keep) < len(rows):
        rest = rows[len(keep) :]
        tokens = sum(r[2] for r in rest)
        hits = sum(r[3] for r in rest)
        value = hits / tokens if tokens else 0.0
        tip = (
            f"{len(rest)} other tenants: token hit ratio {value:.1%} "
            f"({hits:,} of {tokens:,} tokens)"
        )
        bars.append(Bar(f"other ({len(rest)})", value, tip, COLORS["hit"], rest=True))
    return bar_chart(
        bars,
        title=fig["title"],
        y_label="token hit ratio",
        y_max=_ratio_top(max(b.value for b in bars)),
        y_format=_percent,
    )


def svg_per_tier(fig: dict[str, Any]) -> str:
    """Share of prompt tokens each source served.

    Args:
        fig: the ``per_tier`` figure.

    Returns:
        The ``<svg>`` element.
    """
    caps = fig.get("tier_capacity_blocks", {})
    bars = []
    for source, tokens, share in zip(
        fig["sources"], fig["hit_tokens"], fig["share_of_prompt_tokens"]
    ):
        held = f", a tier of {caps[source]:,} blocks" if source in caps else ""
        tip = f"{source}: {share:.1%} of prompt tokens ({tokens:,} tokens{held})"
        bars.append(Bar(source, share, tip, COLORS.get(source, "#888888")))
    return bar_chart(
        bars,
        title=fig["title"],
        y_label="share of prompt tokens",
        y_max=_ratio_top(max(b.value for b in bars)),
        y_format=_percent,
    )


def svg_capacity_curve(fig: dict[str, Any]) -> str:
    """Block hit ratio against capacity (log scale) per policy, Belady and the ceiling.

    Args:
        fig: the ``capacity_curve`` figure.

    Returns:
        The ``<svg>`` element.
    """
    caps = fig["capacities"]
    lines = []
    for name, ratios in fig["series"].items():
        label = "Belady (offline)" if name == "belady" else name.upper()
        if name == fig["default_policy"]:
            label += " (default)"
        color = COLORS.get(name, "#888888")
        lines.append(Series(label, ratios, color, dashed=name == "belady"))
    ceiling = fig["ceiling"]
    lines.append(Series("infinite cache", [ceiling] * len(caps), COLORS["infinite"], dashed=True))

    def tip(line: Series, capacity: int, value: float) -> str:
        return f"{line.name} at {capacity:,} blocks: block hit ratio {value:.4f}"

    return log_line_chart(
        caps,
        lines,
        title=fig["title"],
        x_label="cache capacity (blocks of 512 tokens)",
        y_label="block hit ratio",
        y_max=max(ceiling * 1.15, 0.05),
        y_format=_percent,
        x_marks=list(fig["tier_capacity_blocks"].items()),
        tip=tip,
    )


SVG_DRAWERS: dict[str, Callable[[dict[str, Any]], str]] = {
    "per_tier": svg_per_tier,
    "per_tenant": svg_per_tenant,
    "capacity_curve": svg_capacity_curve,
}
"""Figure name -> inline SVG drawing; the page draws the other ``plots.DRAWERS`` as PNGs."""
