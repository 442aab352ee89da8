"""The report's terminal summary: the headline numbers and the capacity curve as text."""

from __future__ import annotations

from typing import Any

from cachetier.report.live_curve import live_curve_lines


def render_summary(doc: dict[str, Any]) -> str:
    """A few lines for a terminal.

    Args:
        doc: the report document (``build_report``).

    Returns:
        The text, ending in a newline.
    """
    inp, head, figures = doc["input"], doc["headline"], doc["figures"]
    lines = [f"cachetier report: {inp['kind']} {inp.get('path') or inp.get('stats')}"]
    if "num_lookups" in head:
        tokens = head["num_tokens"]
        by_source = "  ".join(
            f"{s} {format_tokens(n)}" for s, n in head["hit_tokens_by_source"].items() if n
        )
        lines += [
            f"  lookups            {head['num_lookups']:,} ({head['num_tenants']} tenant(s))",
            f"  prompt tokens      {tokens:,}",
            f"  served from cache  {head['hit_tokens']:,} ({head['token_hit_ratio']:.1%})"
            + (f"   {by_source}" if by_source else ""),
            f"  lost to alignment  {head['alignment_lost_tokens']:,} tokens",
            f"  prefill saved      {_duration(head['saved_s'])} estimated, "
            f"{_duration(head['net_saved_s'])} net of {_duration(head['restore_s'])} restoring "
            f"(at {figures['saved']['prefill_tokens_per_s']:.1f} tokens/s)",
            f"  load or recompute  {head['loaded_tokens']:,} tokens loaded from tiers, "
            f"{head['recomputed_by_choice_tokens']:,} recomputed by choice "
            f"(cost model: {_duration(head['cost_model_est_saved_s'])} saved, estimated)",
        ]
    if "capacity_curve" in figures:
        settings = doc["settings"]
        curve = figures["capacity_curve"]
        lines.append(
            f"  block hit ratio    {head['block_hit_ratio']:.4f} with {settings['cpu_blocks']:,} "
            f"cpu + {settings['disk_blocks']:,} disk blocks ({settings['policy']})"
        )
        names = list(curve["series"])
        lines.append("  capacity curve, block hit ratio:")
        lines.append("    " + f"{'blocks':>9}" + "".join(f"{n:>9}" for n in [*names, "infinite"]))
        for i, capacity in enumerate(curve["capacities"]):
            values = [curve["series"][n][i] for n in names] + [curve["ceiling"]]
            lines.append("    " + f"{capacity:>9,}" + "".join(f"{v:>9.4f}" for v in values))
        verdict = "yes" if curve["default_ge_lru_at_every_capacity"] else "NO"
        lines.append(
            f"  default policy ({curve['default_policy']}) >= LRU at every capacity: {verdict}"
        )
    if "admission" in figures:
        lines += _admission_lines(figures["admission"])
    if "tier_counters" in figures:
        table = figures["tier_counters"]
        cols = table["columns"]
        lines.append(f"  counters from {table['source']}:")
        for row in table["rows"]:
            values = dict(zip(cols, row))
            rate = values.get("hit_rate")
            lines.append(
                f"    {values['group']:<6} {values['name']:<12} hits {values['hits'] or 0:>10,}"
                f"  misses {values['misses'] or 0:>10,}"
                + (f"  hit rate {rate:.3f}" if isinstance(rate, float) else "")
            )
    if "live_curve" in figures:
        lines += live_curve_lines(figures["live_curve"])
    steps = ", ".join(f"{k.removesuffix('_s')} {v:.1f} s" for k, v in doc["timings_s"].items())
    lines.append(
        f"  inputs read and figures computed in {doc['build_s']:.1f} s"
        + (f" ({steps})" if steps else "")
    )
    return "\n".join(lines) + "\n"


def _admission_lines(fig: dict[str, Any]) -> list[str]:
    """Each admission policy's block hit ratio and disk writes against store-all's."""
    names = fig["policies"]
    lines = [
        f"  admission, over {fig['cpu_blocks']:,} cpu blocks: block hit ratio (disk written / all)",
        "    " + f"{'disk':>9}" + "".join(f"{n:>20}" for n in names),
    ]
    for i, capacity in enumerate(fig["capacities"]):
        cells = [
            f"{fig['block_hit_ratio'][n][i]:.4f} ({fig['disk_written_vs_all'][n][i]:.2f})"
            for n in names
        ]
        lines.append("    " + f"{capacity:>9,}" + "".join(f"{c:>20}" for c in cells))
    return lines


def format_tokens(count: int) -> str:
    """A token count for people: ``812``, ``64.5k``, ``31.15M``.

    Args:
        count: tokens.

    Returns:
        The count, shortened with ``k`` or ``M`` from 10,000 on.
    """
    if count >= 10**6:
        return f"{count / 1e6:.2f}M"
    return f"{count / 1e3:.1f}k" if count >= 10**4 else f"{count:,}"


def _duration(seconds: float) -> str:
    """Seconds for people: ``12.0 s``, ``3.5 min``, ``127.6 h``."""
    if abs(seconds) >= 3600:
        return f"{seconds / 3600:,.1f} h"
    return f"{seconds / 60:.1f} min" if abs(seconds) >= 60 else f"{seconds:.1f} s"
