"""What the adaptive policy learnt, kept in a small file beside the disk tier across restarts.

One JSON document: ``{"version", "tiers": {tier: TierSimulation.snapshot()}, "crc32"}``, the
checksum over the canonical JSON of ``tiers``. A file that is missing, larger than ``MAX_BYTES``,
not JSON, of another version, whose checksum does not match, or holding a choice that is not a
fixed policy or a score that is not a finite number >= 0 is ignored whole (logged): each tier
then starts as store-all, as on a first start. Writes replace the file whole (a temp file,
fsynced, then a rename), so a reader never sees a torn one; a failed write is logged and
otherwise ignored (the file is a hint, never needed).
"""

from __future__ import annotations

import json
import logging
import math
import os
import zlib
from pathlib import Path
from typing import Any

from cachetier.admission.config import FIXED_POLICIES
from cachetier.util.json_file import read_json, replace_json

log = logging.getLogger(__name__)

VERSION = 1
STATE_FILE_NAME = ".cachetier-admission.json"
"""In the disk tier's folder (a dot-file: the tier's scan passes it by)."""
MAX_BYTES = 64 * 1024
MAX_TIERS = 16


def _checksum(tiers: Any) -> int:
    canonical = json.dumps(tiers, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return zlib.crc32(canonical.encode())


def _count(value: object) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    )


def _valid_tier(name: object, state: object) -> bool:
    if not (isinstance(name, str) and isinstance(state, dict)):
        return False
    hits = state.get("hits")
    return (
        state.get("choice") in FIXED_POLICIES
        and all(
            isinstance(state.get(k), int) and not isinstance(state.get(k), bool) and state[k] >= 0
            for k in ("cheap_blocks", "tier_blocks")
        )
        and _count(state.get("refs"))
        and isinstance(hits, dict)
        and set(hits) == set(FIXED_POLICIES)
        and all(_count(v) for v in hits.values())
    )


class AdmissionStateFile:
    """Where the adaptive policy keeps what it learnt.

    Args:
        path: the file.
        file_mode: permission bits of the file when this process creates it.
    """

    def __init__(self, path: str | os.PathLike[str], file_mode: int = 0o600) -> None:
        self.path = Path(path)
        self._file_mode = file_mode

    def load(self) -> dict[str, dict[str, Any]] | None:
        """The kept state by tier, or ``None`` (no file, or one that is not valid)."""
        try:
            doc = read_json(self.path, MAX_BYTES)
        except ValueError as exc:
            log.warning("ignoring %s: %s; starting as store-all", self.path, exc)
            return None
        if doc is None:
            return None
        try:
            ok = (
                isinstance(doc, dict)
                and doc.get("version") == VERSION
                and isinstance(doc.get("tiers"), dict)
                and len(doc["tiers"]) <= MAX_TIERS
                and doc.get("crc32") == _checksum(doc["tiers"])
                and all(_valid_tier(n, s) for n, s in doc["tiers"].items())
            )
        except (ValueError, TypeError, RecursionError):
            ok = False
        if not ok:
            log.warning(
                "ignoring %s: not a valid admission state; starting as store-all", self.path
            )
            return None
        return doc["tiers"]

    def save(self, tiers: dict[str, dict[str, Any]]) -> None:
        """Keep ``tiers`` (replacing the file whole; a failed write is logged)."""
        doc = {"version": VERSION, "tiers": tiers, "crc32": _checksum(tiers)}
        try:
            replace_json(self.path, doc, self._file_mode, fsync=True)
        except (OSError, ValueError) as exc:
            log.warning("could not keep the admission state in %s: %s", self.path, exc)
