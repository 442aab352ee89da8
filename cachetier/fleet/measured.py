"""A replica's cost model, rebuilt from the figures it reports.

An engine reports its cost model as ``CostModel`` snapshots do (``GET /v1/fleet/state``'s
``prefill`` and ``tiers``; the ``learned`` figures a benchmark records): the prefill model's
coefficients and measured range, and each tier's latency and read speed. A router, or a
simulator, rebuilds that replica's ``CostModel`` from them and estimates with the same code the
engine plans with.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from cachetier.store.costmodel import CostModel, PrefillModel, TierRate, TierRates


def _number(snapshot: Mapping[str, Any], name: str) -> float | None:
    value = snapshot.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) and value >= 0 else None


def prefill_from_snapshot(snapshot: Mapping[str, Any] | None) -> PrefillModel:
    """A ``PrefillModel`` that estimates as the one whose ``snapshot()`` this is.

    The model is fitted from observations only, so it is fed three steps its coefficients
    predict exactly; with no forgetting, least squares lands on those coefficients, and the
    largest step fed is the snapshot's measured range (so ``covers`` answers as the engine's
    does).

    Args:
        snapshot: ``PrefillModel.snapshot()``'s ``step_s``, ``s_per_token``,
            ``s_per_attention``, ``max_step_tokens`` and ``max_step_attention``; ``None`` or
            one without coefficients gives an unmeasured model.

    Returns:
        The model (``coefficients`` ``None`` when unmeasured).
    """
    model = PrefillModel(decay=1.0)
    if not snapshot:
        return model
    coef = [_number(snapshot, k) for k in ("step_s", "s_per_token", "s_per_attention")]
    if any(c is None for c in coef):
        return model
    c0, c1, c2 = (c or 0.0 for c in coef)
    max_tokens = max(int(_number(snapshot, "max_step_tokens") or 0), 2)
    max_attention = max(_number(snapshot, "max_step_attention") or 0.0, 1.0)
    # Three steps that pin the plane: one token and no context, many tokens and no context,
    # and the measured range's corner.
    for tokens, attention in ((1, 0.0), (max_tokens, 0.0), (max_tokens, max_attention)):
        model.observe(tokens, attention, c0 + c1 * tokens + c2 * attention)
    return model


def tier_rates_from_snapshot(snapshot: Mapping[str, Mapping[str, Any]]) -> TierRates:
    """``TierRates`` holding each tier of ``TierRates.snapshot()`` that has a read speed.

    Args:
        snapshot: per tier, ``latency_ms`` and ``read_gbps`` (a tier without a read speed
            is left out: unmeasured).

    Returns:
        The rates.
    """
    rates = TierRates()
    for tier, figures in snapshot.items():
        gbps = _number(figures, "read_gbps")
        latency_ms = _number(figures, "latency_ms") or 0.0
        reads = _number(figures, "reads") or 1.0
        if not gbps:
            continue
        rates.adopt(tier, TierRate(latency_ms / 1e3, 1e-9 / gbps, int(reads), 0.0))
    return rates


def cost_model_from_snapshot(
    prefill: Mapping[str, Any] | None, tiers: Mapping[str, Mapping[str, Any]]
) -> CostModel:
    """The cost model of a replica that reported these figures.

    Args:
        prefill: its ``PrefillModel.snapshot()`` (``None``: not measured yet).
        tiers: its ``TierRates.snapshot()``.

    Returns:
        A ``CostModel`` over them.
    """
    # Never probing: a probe is the engine's read of a tier it has avoided, and an estimate
    # that changed with the wall clock would make a decision depend on more than its inputs.
    # Not logged: a decision plans for every replica, and no engine runs those plans.
    return CostModel(
        tier_rates_from_snapshot(tiers),
        prefill_from_snapshot(prefill),
        probe_interval_s=math.inf,
        log_refusals=False,
    )
