"""The live capacity curve of a server or store (``cachetier.admission.live_curve``), as a figure
of the report: what each tier would hit at a half, two and four times its capacity."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from cachetier.admission.live_curve import CAPACITY_FACTORS, factor_label

FACTOR_LABELS = tuple(factor_label(f) for f in CAPACITY_FACTORS)
"""The curve's points, as ``GET /v1/stats`` and the metrics label them."""


def live_curve_figure(stats: Mapping[str, Any], source: str) -> dict[str, Any] | None:
    """The live curve of ``stats``, one row per tier.

    Args:
        stats: a ``GET /v1/stats`` body or a ``TieredStore.stats()`` dump.
        source: the file or URL it came from.

    Returns:
        The figure (``columns``, ``rows``: tier, capacity in blocks, sample rate, lookups, then
        the block hit ratio at each factor, ``None`` where a value is missing or not a
        number in [0, 1]); ``None`` when the stats carry no curve (an older server, the curve
        off, a non-admin token).
    """
    curve = stats.get("live_curve")
    if not isinstance(curve, Mapping):
        return None
    rows = [_row(str(tier), figures) for tier, figures in curve.items()]
    rows = [row for row in rows if row is not None]
    if not rows:
        return None
    choices = _choices(stats)
    return {
        "title": "What more capacity would buy (live)",
        "how": (
            f"From {source}: per tier, the block hit ratio the server's lookups since it started "
            "would have had in one LRU cache of 0.5, 1, 2 and 4 times the tier's capacity "
            "(hit = the leading run of a lookup's blocks the cache holds, then all of them "
            "stored, as in the capacity curve of a trace replay), measured on a hashed sample "
            "of keys at the rate shown (1: every key, exact)."
            + (
                " Admission now: " + ", ".join(f"{t} {c}" for t, c in choices.items()) + "."
                if choices
                else ""
            )
        ),
        "source": source,
        "columns": [
            "tier",
            "capacity_blocks",
            "sample_rate",
            "num_lookups",
            *(f"x{label}" for label in FACTOR_LABELS),
        ],
        "rows": rows,
        "admission_choices": choices,
    }


def _row(tier: str, figures: object) -> list[Any] | None:
    if not isinstance(figures, Mapping) or not isinstance(figures.get("hit_ratio"), Mapping):
        return None
    ratios = figures["hit_ratio"]
    return [
        tier,
        _number(figures.get("capacity_blocks")),
        _number(figures.get("sample_rate")),
        _number(figures.get("num_lookups")),
        *(_ratio(ratios.get(label)) for label in FACTOR_LABELS),
    ]


def _number(value: object) -> int | float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value if math.isfinite(value) else None


def _ratio(value: object) -> float | None:
    number = _number(value)
    return float(number) if number is not None and 0 <= number <= 1 else None


def _choices(stats: Mapping[str, Any]) -> dict[str, str]:
    admission = stats.get("admission")
    choices = admission.get("choices") if isinstance(admission, Mapping) else None
    if not isinstance(choices, Mapping):
        return {}
    return {str(t): str(c) for t, c in choices.items()}


def live_curve_lines(figure: Mapping[str, Any]) -> list[str]:
    """The figure as lines of the terminal summary."""
    lines = ["  what more capacity would buy (live, block hit ratio):"]
    lines.append(
        "    "
        + f"{'tier':<10}{'blocks':>10}"
        + "".join(f"{'x' + label:>9}" for label in FACTOR_LABELS)
    )
    for tier, capacity, _rate, _lookups, *ratios in figure["rows"]:
        cells = "".join(f"{'-':>9}" if r is None else f"{r:>9.4f}" for r in ratios)
        blocks = f"{capacity:>10,}" if isinstance(capacity, int) else f"{'-':>10}"
        lines.append(f"    {tier:<10}{blocks}{cells}")
    if figure["admission_choices"]:
        chosen = ", ".join(f"{t} {c}" for t, c in figure["admission_choices"].items())
        lines.append(f"    admission now: {chosen}")
    return lines
