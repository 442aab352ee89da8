"""The measured figures ``benchmarks.fleet_sim`` gives its simulated replicas, read from the
results the repository records (``docs/results/*.json``) when it runs.

- prefill: ``cost_model.json``'s ``learned.prefill``, the prefill model our engine fitted
  while serving SmolLM2-135M-Instruct (``benchmarks.cost_model``): seconds per step, per token
  and per unit of attention work, and the largest step it measured;
- bytes per token: ``restart.json``'s ``disk_restored_bytes`` over the tokens restored from
  disk (``restored_tokens.disk.disk``), the KV of one SmolLM2 token;
- disk and Redis: ``restart.json``'s ``ttft_breakdown``, an engine restarted over each tier
  restoring the same prompt (``benchmarks.restart``): ``lookup_s`` as the round trip, and the
  restored bytes over ``restore_read_s`` as the read speed.

Every figure is given in the ``CostModel`` snapshot shape (``cachetier.fleet.measured``), and
``sources`` says which field of which file each came from.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"
PREFILL_FIELDS = (
    "step_s",
    "s_per_token",
    "s_per_attention",
    "max_step_tokens",
    "max_step_attention",
)


@dataclass(frozen=True, slots=True)
class FleetRates:
    """The figures a simulated replica runs at.

    Args:
        model: the model they were measured on.
        prefill: ``PrefillModel.snapshot()`` figures.
        tiers: ``TierRates.snapshot()`` figures, ``disk`` and ``redis``.
        bytes_per_token: KV bytes of one token.
        sources: per figure, the file and field it was read from.
    """

    model: str
    prefill: dict[str, Any]
    tiers: dict[str, dict[str, float]]
    bytes_per_token: int
    sources: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "prefill": self.prefill,
            "tiers": self.tiers,
            "bytes_per_token": self.bytes_per_token,
            "sources": self.sources,
        }


def _load(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the recorded figures in {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    return data


def _tier(restart: dict[str, Any], tier: str, bytes_per_token: int) -> dict[str, float]:
    parts = restart["ttft_breakdown"][tier]
    nbytes = bytes_per_token * restart["restored_tokens"][tier][tier]
    return {
        "latency_ms": 1e3 * parts["lookup_s"],
        "read_gbps": nbytes / parts["restore_read_s"] / 1e9,
    }


def measured_rates(results: Path = RESULTS) -> FleetRates:
    """The recorded figures in ``results`` (see the module's docstring).

    Args:
        results: the folder of ``cost_model.json`` and ``restart.json``.

    Returns:
        The figures, with where each came from.

    Raises:
        ValueError: a file is missing or lacks a field named above.
    """
    cost_path, restart_path = results / "cost_model.json", results / "restart.json"
    cost, restart = _load(cost_path), _load(restart_path)
    try:
        learned = cost["learned"]["prefill"]
        prefill = {k: learned[k] for k in PREFILL_FIELDS}
        restored = restart["restored_tokens"]["disk"]["disk"]
        bytes_per_token = round(restart["disk_restored_bytes"] / restored)
        tiers = {t: _tier(restart, t, bytes_per_token) for t in ("disk", "redis")}
        model = str(cost.get("model", "?"))
    except (KeyError, TypeError, ZeroDivisionError) as exc:
        raise ValueError(f"{cost_path} or {restart_path} lacks a figure: {exc!r}") from None
    sources = {
        "prefill": f"{cost_path.name}: learned.prefill ({cost.get('model')})",
        "bytes_per_token": f"{restart_path.name}: disk_restored_bytes / restored_tokens.disk.disk",
        "disk": f"{restart_path.name}: ttft_breakdown.disk (lookup_s; restored bytes / "
        "restore_read_s)",
        "redis": f"{restart_path.name}: ttft_breakdown.redis (lookup_s; restored bytes / "
        "restore_read_s)",
    }
    return FleetRates(model, prefill, tiers, bytes_per_token, sources)
