"""The connector's counters as vLLM's ``KVConnectorStats`` (logged as "KV Transfer metrics")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

# Counters a worker adds up over one logging interval (blocks unless named *_bytes / *_s).
COUNTERS = (
    "num_loaded_blocks",
    "num_load_errors",
    "num_async_loads",  # requests loaded beside the forwards (counted, not blocks)
    "num_saved_blocks",
    "num_save_errors",
    "loaded_bytes",
    "saved_bytes",
    "load_s",
    "copy_s",  # the part of load_s spent copying restored records into vLLM's KV memory
    "save_s",
)


@dataclass
class CacheTierConnectorStats(KVConnectorStats):
    """Sums of ``COUNTERS`` plus ``loaded_from_<tier>`` counts; picklable plain data."""

    def __post_init__(self) -> None:
        for name in COUNTERS:
            self.data.setdefault(name, 0)

    def add(self, **counts: float) -> None:
        """Add to named counters (``loaded_from_<tier>`` names are created on first use)."""
        for name, value in counts.items():
            self.data[name] = self.data.get(name, 0) + value

    def reset(self) -> None:
        self.data = {name: 0 for name in COUNTERS}

    def aggregate(self, other: KVConnectorStats) -> CacheTierConnectorStats:
        merged = CacheTierConnectorStats(dict(self.data))
        merged.add(**other.data)
        return merged

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {
            name: round(value, 4) if isinstance(value, float) else value
            for name, value in self.data.items()
        }
        load_s, save_s = self.data.get("load_s", 0), self.data.get("save_s", 0)
        out["load_MBps"] = round(self.data["loaded_bytes"] / load_s / 1e6, 1) if load_s else 0.0
        out["save_MBps"] = round(self.data["saved_bytes"] / save_s / 1e6, 1) if save_s else 0.0
        return out

    def is_empty(self) -> bool:
        return not any(
            self.data.get(name)
            for name in (
                "num_loaded_blocks",
                "num_load_errors",
                "num_saved_blocks",
                "num_save_errors",
            )
        )

    def to_dict(self) -> dict[str, Any]:
        return dict(self.data)
