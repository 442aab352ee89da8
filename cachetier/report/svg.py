"""Inline SVG charts for the HTML page: every bar and point is an element a reader can hover.

A matplotlib PNG is a picture: its values can only be read off the axes. Here each mark carries
its value twice, as an SVG ``<title>`` (the browser's own tooltip, no script needed) and as
``data-tip`` (the page's script shows it at once, see ``page_script``), and a tenant's bar
carries ``data-tenant`` so the page's tenant filter can hide the others. Every text that came
from an input (tenant names above all) is escaped here: none is trusted.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from html import escape

WIDTH, HEIGHT = 760, 320
_LEFT, _RIGHT, _TOP = 64, 16, 30
_LEGEND_COLUMN = 170


@dataclass(frozen=True, slots=True)
class Bar:
    """One bar: its axis label, height, hover text, colour, and the tenant it belongs to
    (``None`` for a bar of no one tenant; ``rest`` for one adding up several)."""

    label: str
    value: float
    tip: str
    color: str
    tenant: str | None = None
    rest: bool = False


@dataclass(frozen=True, slots=True)
class Series:
    """One line of a line chart: a name for the legend, a value per x (``None``: no point)."""

    name: str
    values: Sequence[float | None]
    color: str
    dashed: bool = False


def _attr(text: str) -> str:
    return escape(text, quote=True)


def _frame(body: list[str], title: str, bottom: int) -> str:
    return (
        f'<svg class="plot" role="img" viewBox="0 0 {WIDTH} {HEIGHT + bottom}" '
        f'width="{WIDTH}" height="{HEIGHT + bottom}">'
        f"<title>{escape(title)}</title>"
        f'<text class="chart-title" x="{WIDTH / 2:.0f}" y="18" text-anchor="middle">'
        f"{escape(title)}</text>" + "".join(body) + "</svg>"
    )


def nice_top(largest: float) -> tuple[float, int]:
    """A round top for a y axis at or above ``largest``, and how many even steps reach it.

    Args:
        largest: the largest value drawn (positive).

    Returns:
        The top and the number of steps (4 to 6): steps are 1, 2, 2.5 or 5 times a power of 10.
    """
    if not largest > 0:
        raise ValueError(f"the largest value must be positive, got {largest}")
    power = 10 ** math.floor(math.log10(largest / 4))
    for multiple in (1, 2, 2.5, 5, 10):
        step = multiple * power
        if largest <= step * 6:
            num_steps = max(4, math.ceil(largest / step - 1e-9))
            return step * num_steps, num_steps
    raise AssertionError("unreachable: 10 steps of ten times the power cover any value")


def _y_axis(y_max: float, y_format: Callable[[float], str], y_label: str) -> tuple[list[str], int]:
    """Gridlines and tick labels at round steps from 0 to ``y_max``; the plot's bottom y."""
    bottom = HEIGHT - 40
    top, num_steps = nice_top(y_max)
    assert abs(top - y_max) < 1e-9 * top, "y_max is a nice_top() value"
    out = []
    for i in range(num_steps + 1):
        value = top * i / num_steps
        y = bottom - (bottom - _TOP) * i / num_steps
        out.append(
            f'<line class="grid" x1="{_LEFT}" x2="{WIDTH - _RIGHT}" y1="{y:.1f}" y2="{y:.1f}"/>'
            f'<text class="tick" x="{_LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">'
            f"{escape(y_format(value))}</text>"
        )
    mid = (bottom + _TOP) / 2
    out.append(
        f'<text class="axis-label" transform="translate(14 {mid:.0f}) rotate(-90)" '
        f'text-anchor="middle">{escape(y_label)}</text>'
    )
    return out, bottom


def _scale_y(value: float, y_max: float, bottom: int) -> float:
    return bottom - (bottom - _TOP) * min(max(value / y_max, 0.0), 1.0)


def bar_chart(
    bars: Sequence[Bar],
    *,
    title: str,
    y_label: str,
    y_max: float,
    y_format: Callable[[float], str],
) -> str:
    """Vertical bars, one per item, labelled below.

    Args:
        bars: the bars, left to right.
        title: the chart's title.
        y_label: what the y axis measures.
        y_max: the y axis reaches at least this (rounded up to a round step); values above
            it are drawn at the top.
        y_format: a y value as tick text.

    Returns:
        The ``<svg>`` element as text.
    """
    if not bars:
        raise ValueError("a bar chart needs at least one bar")
    if not y_max > 0:
        raise ValueError(f"y_max must be positive, got {y_max}")
    y_max = nice_top(y_max)[0]
    body, bottom = _y_axis(y_max, y_format, y_label)
    band = (WIDTH - _LEFT - _RIGHT) / max(len(bars), 3)
    start = _LEFT + (WIDTH - _LEFT - _RIGHT - band * len(bars)) / 2
    slanted = len(bars) > 4
    for i, bar in enumerate(bars):
        x = start + band * i + band * 0.2
        y = _scale_y(bar.value, y_max, bottom)
        who = "" if bar.tenant is None else f' data-tenant="{_attr(bar.tenant)}"'
        who += ' data-tenants-rest=""' if bar.rest else ""
        centre = x + band * 0.3
        label = (
            f'transform="translate({centre:.1f} {bottom + 14}) rotate(-30)" text-anchor="end"'
            if slanted
            else f'x="{centre:.1f}" y="{bottom + 16}" text-anchor="middle"'
        )
        body.append(
            f"<g{who}>"
            f'<rect class="mark" x="{x:.1f}" y="{y:.1f}" width="{band * 0.6:.1f}" '
            f'height="{bottom - y:.1f}" fill="{_attr(bar.color)}" data-tip="{_attr(bar.tip)}">'
            f"<title>{escape(bar.tip)}</title></rect>"
            f'<text class="tick" {label}>{escape(bar.label)}</text></g>'
        )
    body.append(
        f'<line class="axis" x1="{_LEFT}" x2="{WIDTH - _RIGHT}" y1="{bottom}" y2="{bottom}"/>'
    )
    return _frame(body, title, 60 if slanted else 10)


def log_line_chart(
    xs: Sequence[int],
    series: Sequence[Series],
    *,
    title: str,
    x_label: str,
    y_label: str,
    y_max: float,
    y_format: Callable[[float], str],
    x_marks: Sequence[tuple[str, int]] = (),
    tip: Callable[[Series, int, float], str],
) -> str:
    """Lines over a log-scale x axis, a hoverable point at each value.

    Args:
        xs: the x values, ascending and positive.
        series: the lines.
        title: the chart's title.
        x_label: what the x axis measures.
        y_label: what the y axis measures.
        y_max: the y axis reaches at least this (rounded up to a round step).
        y_format: a y value as tick text.
        x_marks: labelled vertical lines (a tier's capacity).
        tip: the hover text of one point, from its series, x and y.

    Returns:
        The ``<svg>`` element as text.
    """
    if not xs or min(xs) <= 0:
        raise ValueError("a log-scale chart needs positive x values")
    if not y_max > 0:
        raise ValueError(f"y_max must be positive, got {y_max}")
    y_max = nice_top(y_max)[0]
    body, bottom = _y_axis(y_max, y_format, y_label)
    low, high = math.log10(min(xs)), math.log10(max(xs))
    span = (high - low) or 1.0
    plot_w = WIDTH - _LEFT - _RIGHT - 20

    def scale_x(x: float) -> float:
        return _LEFT + 10 + plot_w * (math.log10(x) - low) / span

    for name, x in x_marks:
        px = scale_x(x)
        body.append(
            f'<line class="x-mark" x1="{px:.1f}" x2="{px:.1f}" y1="{_TOP}" y2="{bottom}"/>'
            f'<text class="tick" x="{px + 3:.1f}" y="{_TOP + 10}">{escape(name)} {x:,}</text>'
        )
    for x in xs:
        body.append(
            f'<text class="tick" x="{scale_x(x):.1f}" y="{bottom + 16}" text-anchor="middle">'
            f"{x:,}</text>"
        )
    for index, line in enumerate(series):
        body += _line_marks(line, index, xs, scale_x, y_max, bottom, tip)
    body.append(
        f'<line class="axis" x1="{_LEFT}" x2="{WIDTH - _RIGHT}" y1="{bottom}" y2="{bottom}"/>'
        f'<text class="axis-label" x="{WIDTH / 2:.0f}" y="{bottom + 34}" text-anchor="middle">'
        f"{escape(x_label)}</text>"
    )
    return _frame(body, title, 34 + 16 * -(-len(series) // 4))


def _line_marks(
    line: Series,
    index: int,
    xs: Sequence[int],
    scale_x: Callable[[float], float],
    y_max: float,
    bottom: int,
    tip: Callable[[Series, int, float], str],
) -> list[str]:
    """One series of ``log_line_chart``: its line, a hoverable point per value, and its legend
    entry (the ``index``-th, below the x axis at ``bottom``)."""
    points = [(scale_x(x), v) for x, v in zip(xs, line.values) if v is not None]
    path = " ".join(f"{px:.1f},{_scale_y(v, y_max, bottom):.1f}" for px, v in points)
    dash = ' stroke-dasharray="6 4"' if line.dashed else ""
    out = [
        f'<polyline points="{path}" fill="none" stroke="{_attr(line.color)}" '
        f'stroke-width="2"{dash}/>'
    ]
    for x, v in zip(xs, line.values):
        if v is None:
            continue
        text = tip(line, x, v)
        out.append(
            f'<circle class="mark" cx="{scale_x(x):.1f}" cy="{_scale_y(v, y_max, bottom):.1f}" '
            f'r="4.5" fill="{_attr(line.color)}" data-tip="{_attr(text)}">'
            f"<title>{escape(text)}</title></circle>"
        )
    # The legend sits below the x axis, four to a row: inside, it would hide the lines.
    lx = _LEFT + _LEGEND_COLUMN * (index % 4)
    ly = bottom + 58 + 16 * (index // 4)
    out.append(
        f'<line x1="{lx}" x2="{lx + 20}" y1="{ly - 4}" y2="{ly - 4}" '
        f'stroke="{_attr(line.color)}" stroke-width="2"{dash}/>'
        f'<text class="legend" x="{lx + 26}" y="{ly}">{escape(line.name)}</text>'
    )
    return out
