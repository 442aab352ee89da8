"""Matplotlib drawings of the report's figures (``figures`` dicts in, PNG bytes out).

Only ``matplotlib.figure.Figure`` is used, never ``pyplot``: no global figure state, no GUI
backend, safe in a server process.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, PercentFormatter

from cachetier.report.figures import MAX_TENANTS_PLOTTED
from cachetier.report.summary import format_tokens

COLORS = {
    "pool": "#2ca02c",
    "cpu": "#1f77b4",
    "disk": "#ff7f0e",
    "redis": "#d62728",
    "remote": "#9467bd",
    "lru": "#1f77b4",
    "s3fifo": "#2ca02c",
    "arc": "#9467bd",
    "belady": "#d62728",
    "infinite": "#555555",
    "alignment_lost": "#e6ab02",
    "hit": "#7f7f7f",
    "prefilled": "#dddddd",
}


def _time_axis(seconds: list[float], span_s: float) -> tuple[np.ndarray, float, str]:
    """Times in the unit that suits the span: seconds, minutes or hours."""
    for scale, name in ((1.0, "seconds"), (60.0, "minutes"), (3600.0, "hours")):
        if span_s <= 120 * scale or name == "hours":
            return np.asarray(seconds, dtype=np.float64) / scale, scale, name
    raise AssertionError("unreachable: hours is always chosen last")


def _unit(largest: float, units: tuple[tuple[float, str], ...]) -> tuple[float, str]:
    """The largest unit that keeps ``largest`` at or above 1 (the first one otherwise)."""
    chosen = units[0]
    for scale, name in units:
        if largest >= scale:
            chosen = (scale, name)
    return chosen


def _values(ratios: list[float | None]) -> np.ndarray:
    return np.array([np.nan if r is None else r for r in ratios], dtype=np.float64)


def draw_hit_rate_over_time(ax: Axes, fig: dict[str, Any]) -> None:
    """Token hit ratio per bin as stacked bars by source, and the infinite cache dashed.

    Bars, not a filled area: a bin without lookups stays empty instead of reading as 0%.
    """
    width_s = fig["bin_s"]
    span = len(fig["bin_start_s"]) * width_s
    x, scale, unit = _time_axis(fig["bin_start_s"], span)
    width = width_s / scale
    bottom = np.zeros(len(x))
    for source, ratios in fig["token_hit_ratio_by_source"].items():
        values = _values(ratios)
        ax.bar(
            x,
            values,
            width,
            bottom=bottom,
            align="edge",
            color=COLORS.get(source, "#888888"),
            label=f"hit from {source}",
            linewidth=0,
        )
        bottom = bottom + np.nan_to_num(values)
    top = float(bottom.max(initial=0.0))
    if "ceiling_token_hit_ratio" in fig:
        ceiling = _values(fig["ceiling_token_hit_ratio"])
        ax.plot(x + width / 2, ceiling, "--", color=COLORS["infinite"], label="infinite cache")
        top = max(top, float(np.nanmax(ceiling, initial=0.0)))
    ax.set_xlabel(f"{unit} from the first lookup")
    ax.set_ylabel("token hit ratio")
    ax.set_ylim(0, min(1.0, max(top, 0.04) * 1.3))
    ax.set_xlim(0, span / scale)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(fig["title"])


def draw_per_tier(ax: Axes, fig: dict[str, Any]) -> None:
    """Share of prompt tokens each source served."""
    sources, shares = fig["sources"], fig["share_of_prompt_tokens"]
    bars = ax.barh(sources, shares, color=[COLORS.get(s, "#888888") for s in sources])
    for bar, tokens, share in zip(bars, fig["hit_tokens"], shares):
        ax.annotate(
            f" {share:.1%}  ({format_tokens(tokens)} tokens)",
            (bar.get_width(), bar.get_y() + bar.get_height() / 2),
            va="center",
            fontsize=9,
        )
    caps = fig.get("tier_capacity_blocks", {})
    ax.set_yticks(range(len(sources)))
    ax.set_yticklabels([f"{s}\n{caps[s]:,} blocks" if s in caps else s for s in sources])
    ax.invert_yaxis()
    ax.set_xlim(0, max(max(shares) * 1.6, 0.05))
    ax.xaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
    ax.set_xlabel("share of all prompt tokens served from the tier")
    ax.set_title(fig["title"])


def draw_per_tenant(ax: Axes, fig: dict[str, Any]) -> None:
    """Token hit ratio per tenant, largest tenants first; the tail as one bar."""
    names = list(fig["tenants"])
    tokens = list(fig["num_tokens"])
    hits = list(fig["hit_tokens"])
    if len(names) > MAX_TENANTS_PLOTTED:
        keep = MAX_TENANTS_PLOTTED - 1
        rest = len(names) - keep
        names = [*names[:keep], f"other ({rest})"]
        tokens = [*tokens[:keep], sum(tokens[keep:])]
        hits = [*hits[:keep], sum(hits[keep:])]
    ratios = [h / t if t else 0.0 for h, t in zip(hits, tokens)]
    total = sum(tokens) or 1
    bars = ax.bar(range(len(names)), ratios, color=COLORS["cpu"], width=0.6)
    for bar, t in zip(bars, tokens):
        ax.annotate(
            f"{t / total:.0%}\nof tokens",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_xticks(range(len(names)))
    ax.set_xlim(-0.5 - max(0, 3 - len(names)) / 2, len(names) - 0.5 + max(0, 3 - len(names)) / 2)
    ax.set_xticklabels(
        [n or "(none)" for n in names],
        rotation=30 if len(names) > 4 else 0,
        ha="right" if len(names) > 4 else "center",
        fontsize=8,
    )
    ax.set_ylim(0, min(1.0, max(ratios, default=0) * 1.35 + 0.05))
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_ylabel("token hit ratio")
    ax.set_title(fig["title"])


def draw_saved(ax: Axes, fig: dict[str, Any]) -> None:
    """Cumulative estimated prefill time saved, with the tokens on a second axis."""
    # Each curve starts at nothing saved at the first lookup.
    x, _, unit = _time_axis([0.0, *fig["bin_end_s"]], fig["bin_end_s"][-1])
    rate = fig["prefill_tokens_per_s"]
    gross_s = np.asarray([0, *fig["cumulative_hit_tokens"]], dtype=np.float64) / rate
    t_scale, t_name = _unit(
        float(gross_s.max()), ((1.0, "seconds"), (60.0, "minutes"), (3600.0, "hours"))
    )
    ax.plot(
        x, gross_s / t_scale, color=COLORS["cpu"], label="estimated (hit tokens / prefill rate)"
    )
    if fig["restore_s"] > 0:
        net = np.asarray([0.0, *fig["cumulative_net_saved_s"]]) / t_scale
        ax.plot(x, net, color=COLORS["disk"], label="net of restore time")
    n_scale, n_name = _unit(
        float(gross_s.max() * rate), ((1.0, ""), (1e3, " (thousands)"), (1e6, " (millions)"))
    )
    tokens_axis = ax.secondary_yaxis(
        "right",
        functions=(lambda v: v * t_scale * rate / n_scale, lambda n: n * n_scale / rate / t_scale),
    )
    tokens_axis.set_ylabel(f"prefill tokens saved{n_name}")
    ax.set_xlabel(f"{unit} from the first lookup")
    ax.set_ylabel(f"prefill {t_name} saved at {rate:.0f} tokens/s")
    ax.set_ylim(bottom=0)
    ax.set_xlim(0, x.max())
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(fig["title"])


def draw_alignment(ax: Axes, fig: dict[str, Any]) -> None:
    """Where every prompt token went: each tier, lost to alignment, prefilled."""
    rows = fig["breakdown"]
    labelled: set[str] = set()
    for y, parts in enumerate(rows.values()):
        total = sum(parts.values()) or 1
        left = 0.0
        for part, count in parts.items():
            share = count / total
            color = COLORS.get(part.removeprefix("hit_"), COLORS["infinite"])
            label = part.replace("_", " ").replace("hit ", "hit from ")
            label = "hit (infinite cache)" if label == "hit" else label
            if part == "alignment_lost":
                # Often too thin to see: the legend carries the share.
                label = f"lost to alignment ({fig['share_of_prompt_tokens']:.2%})"
            ax.barh(
                y, share, 0.6, left=left, color=color, label=None if label in labelled else label
            )
            labelled.add(label)
            if share >= 0.05:
                text = "#333333" if part == "prefilled" else "white"
                ax.annotate(
                    f"{share:.1%}",
                    (left + share / 2, y),
                    ha="center",
                    va="center",
                    fontsize=8,
                    color=text,
                )
            left += share
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(list(rows))
    pad = max(0, 2 - len(rows)) * 0.25  # one bar alone stays as thick as one of two
    ax.set_ylim(len(rows) - 0.5 + pad, -0.5 - pad)  # first row on top
    ax.set_xlim(0, 1)
    ax.xaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_xlabel(f"share of prompt tokens ({fig['alignment_lost_tokens']:,} lost to alignment)")
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=5, fontsize=8, frameon=False)
    ax.set_title(fig["title"], pad=22)


def draw_capacity_curve(ax: Axes, fig: dict[str, Any]) -> None:
    """Block hit ratio against capacity (log scale) per policy, Belady and the ceiling."""
    caps = fig["capacities"]
    for name, ratios in fig["series"].items():
        label = name.upper() if name != "belady" else "Belady (offline)"
        if name == fig["default_policy"]:
            label += " (default)"
        style = "--" if name == "belady" else "-"
        ax.plot(caps, ratios, style, marker="o", ms=3.5, color=COLORS.get(name), label=label)
    ax.axhline(fig["ceiling"], color=COLORS["infinite"], ls=":", label="infinite cache")
    for tier, blocks in fig["tier_capacity_blocks"].items():
        ax.axvline(blocks, color="#bbbbbb", lw=0.8, zorder=0)
        ax.annotate(
            f"{tier} {blocks:,}",
            (blocks, 0),
            xycoords=("data", "axes fraction"),
            fontsize=7,
            color="#777777",
            xytext=(3, 3),
            textcoords="offset points",
            rotation=90,
        )
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax.set_xlabel("cache capacity (blocks of 512 tokens)")
    ax.set_ylabel("block hit ratio")
    ax.set_ylim(0, max(fig["ceiling"] * 1.15, 0.05))
    ax.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(fig["title"])


DRAWERS: dict[str, Callable[[Axes, dict[str, Any]], None]] = {
    "hit_rate_over_time": draw_hit_rate_over_time,
    "per_tier": draw_per_tier,
    "per_tenant": draw_per_tenant,
    "saved": draw_saved,
    "alignment": draw_alignment,
    "capacity_curve": draw_capacity_curve,
}
"""Figure name -> drawing function; figures without one (``tier_counters``) are tables."""


def render_png(
    name: str, figure: dict[str, Any], *, size: tuple[float, float] = (7.5, 4.2)
) -> bytes:
    """One figure as a PNG.

    Args:
        name: a key of ``DRAWERS``.
        figure: its dict.
        size: inches.

    Returns:
        The PNG bytes.
    """
    fig = Figure(figsize=size, layout="constrained")
    DRAWERS[name](fig.add_subplot(), figure)
    return _png(fig, dpi=110)


def render_composite(figures: dict[str, dict[str, Any]], title: str) -> bytes:
    """Every drawable figure of a report on one page, two columns.

    Args:
        figures: the report's figures.
        title: a line above them.

    Returns:
        The PNG bytes.
    """
    names = [n for n in DRAWERS if n in figures]
    rows = -(-len(names) // 2)
    fig = Figure(figsize=(15, 4.4 * rows), layout="constrained")
    fig.suptitle(title, fontsize=13)
    for i, name in enumerate(names):
        DRAWERS[name](fig.add_subplot(rows, 2, i + 1), figures[name])
    return _png(fig, dpi=90)


def _png(fig: Figure, dpi: int) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()
