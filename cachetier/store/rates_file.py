"""A tier's measured speed, kept in a small file beside its data across restarts.

A restarted engine's tiers are unmeasured until its first get, and an unmeasured tier is loaded
whatever it costs (``cachetier.store.costmodel``): the very restart the tiers are for was the one
request the cost model could not weigh, and on a fast GPU loading a disk hit can lose to
recomputing it. So a store keeps its disk tier's measured latency and read speed
in the disk folder, and a store opened on that folder starts from them; its own reads then take
over within two or three gets (the averages' weight). Only the disk tier's: its speed is this
node's, while a link's (Redis, a sidecar) may have changed since.

A file that is missing, too large, not JSON, of another version or holding a non-finite or
negative number is ignored (the tier starts unmeasured, as without the file). Writes replace
the file whole (a temp file and a rename), so several engines sharing the folder never read a
torn one; the last writer wins, and all of them measured the same disk.
"""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path

from cachetier.store.costmodel import TierRate
from cachetier.util.json_file import read_json, replace_json

log = logging.getLogger(__name__)

VERSION = 1
# The disk tier's, in its folder (not a namespace: the tier's scan passes it by).
RATES_FILE_NAME = ".cachetier-rates-disk.json"
MAX_BYTES = 4096
# The file is rewritten at most this often while reads keep coming (and once at close).
SAVE_INTERVAL_S = 5.0


class RatesFile:
    """Where one tier's measured rate is kept.

    Args:
        path: the file.
        tier: the name of the tier it holds the rate of.
        file_mode: permission bits of the file when this process creates it.
    """

    def __init__(self, path: str | os.PathLike[str], tier: str, file_mode: int = 0o600) -> None:
        self.path = Path(path)
        self.tier = tier
        self._file_mode = file_mode
        self._last_save = -math.inf

    def load(self) -> TierRate | None:
        """The kept rate, or ``None`` (no file, or one that is not a valid rate)."""
        try:
            doc = read_json(self.path, MAX_BYTES)
            if doc is None:
                return None
            if doc["version"] != VERSION or doc["tier"] != self.tier:
                return None
            latency, spb, reads = doc["latency_s"], doc["seconds_per_byte"], doc["num_reads"]
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring %s: not a rates file of this version (%s)", self.path, exc)
            return None
        numbers_ok = all(
            isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
            for v in (latency, spb, reads)
        )
        if not numbers_ok or spb <= 0:
            log.warning("ignoring %s: a rate that is not a finite positive number", self.path)
            return None
        return TierRate(float(latency), float(spb), int(reads), 0.0)

    def save(self, rate: TierRate | None, *, force: bool = False) -> None:
        """Keep ``rate`` (no more often than ``SAVE_INTERVAL_S`` unless ``force``); a failed
        write is logged and otherwise ignored: the file is a hint, never needed."""
        now = time.monotonic()
        if rate is None or rate.seconds_per_byte is None:
            return
        if not force and now - self._last_save < SAVE_INTERVAL_S:
            return
        self._last_save = now
        doc = {
            "version": VERSION,
            "tier": self.tier,
            "latency_s": rate.latency_s,
            "seconds_per_byte": rate.seconds_per_byte,
            "num_reads": rate.num_reads,
        }
        try:
            replace_json(self.path, doc, self._file_mode)
        except (OSError, ValueError) as exc:
            log.warning("could not keep the %s tier's rate in %s: %s", self.tier, self.path, exc)
