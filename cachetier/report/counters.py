"""The tier counters table, from a server's ``GET /v1/stats`` or a store's ``stats()``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cachetier.tiers.stats import COUNTERS

ADMISSION_COLUMNS = ("admitted", "refused", "bytes_refused")
"""A lower tier's admission decisions (``TieredStore.stats()["admission"]``)."""
COLUMNS = (
    *COUNTERS,
    "hit_rate",
    "latency_p50_ms",
    "latency_p99_ms",
    "used_bytes",
    *ADMISSION_COLUMNS,
)
"""Columns of the table: every ``TierStats`` counter, then derived figures and the admission
decisions (blank if absent)."""


def counters_table(stats: Mapping[str, Any], source: str) -> dict[str, Any]:
    """Per-tier (and per-tenant, from a server) counters as a figure.

    Args:
        stats: a ``GET /v1/stats`` body (``tiers`` and ``tenants``), a ``TieredStore.stats()``
            dump (``tiers``), or one tier's ``stats()``.
        source: the file or URL it came from (printed with the table).

    Returns:
        The figure: ``columns`` and ``rows``, a list of ``[group, name, *values]``, ``group``
        being ``tier`` or ``tenant``; a missing value is ``None``.

    Raises:
        ValueError: ``stats`` holds no counters at all.
    """
    rows: list[list[Any]] = []
    admission = _admission(stats)
    for group, key in (("tier", "tiers"), ("tenant", "tenants")):
        table = stats.get(key)
        if isinstance(table, Mapping):
            rows += [
                [group, str(n), *_values({**v, **admission.get(n, {})} if group == "tier" else v)]
                for n, v in table.items()
                if _has_counters(v)
            ]
    if not rows and _has_counters(stats):
        rows.append(["tier", str(stats.get("tier", "store")), *_values(stats)])
    if not rows:
        raise ValueError(
            f"{source}: no tier counters found (expected GET /v1/stats JSON with 'tiers' or "
            "'tenants', or a store's stats())"
        )
    partial = "tiers" in stats and stats["tiers"] is None
    return {
        "title": "Tier counters",
        "how": (
            f"Counters as the server or store reported them ({source}), since it started. "
            "Counts are blocks; hit_rate = hits / (hits + misses) of block reads; latency is "
            "per batched call over the most recent calls. Unlike the lookup figures these "
            "count every block read, not only leading prefix runs."
            + (" Per-tier rows need an admin tenant's token." if partial else "")
        ),
        "source": source,
        "columns": ["group", "name", *COLUMNS],
        "rows": rows,
    }


def _has_counters(value: object) -> bool:
    return isinstance(value, Mapping) and "hits" in value and "misses" in value


def _values(snapshot: Mapping[str, Any]) -> list[Any]:
    return [snapshot.get(column) for column in COLUMNS]


def _admission(stats: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """Each lower tier's admission counts, where the stats have them."""
    admission = stats.get("admission")
    tiers = admission.get("tiers") if isinstance(admission, Mapping) else None
    if not isinstance(tiers, Mapping):
        return {}
    return {str(t): c for t, c in tiers.items() if isinstance(c, Mapping)}
