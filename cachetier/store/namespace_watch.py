"""``NamespaceWatch``: tell a miss whose tokens are held under another namespace, and warn once.

A block key is chained from the namespace (model, layout, tenant), so an engine of another
build misses every block of the same prompt, and the miss would read ``never_stored``. The
caller that knows the tokens (the engine's bridge, the vLLM connector) notes the token-only
keys of what it stores (``stored``; one a ``GRAIN`` of tokens, so that engines of other block
sizes find each other's) and, when a lookup's run ends on a never-stored key, asks
``explain`` with the tokens: a holder under another descriptor makes the cause
``namespace_mismatch``, naming what differs. Every lookup feeds ``MismatchAlarm``, which logs
once when such misses become a large share.

With a folder (``TokenFiles``: the disk tier's), the index outlives the process: a pod of a new
build started on the folder the old build filled knows at once which tokens the old one held.
Saves run on a short-lived thread at most every ``SAVE_INTERVAL_S`` while keys are noted, and
once at ``close``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np

from cachetier.misses import MismatchAlarm, MissCause, NamespaceDescriptor, TokenIndex, token_keys
from cachetier.misses.token_file import TokenFiles

SAVE_INTERVAL_S = 60.0
GRAIN = 16
ALARM_MIN_LOOKUPS = 32
"""Lookups seen before the alarm may warn, and how often its counts halve."""


def grain(record_tokens: int) -> int:
    """Tokens a token-only key is chained over: ``GRAIN`` where records are whole multiples
    of it, so engines of other block sizes (16, 32, 256...) share keys and a block-size
    mismatch is told; the record itself otherwise."""
    return GRAIN if record_tokens % GRAIN == 0 else record_tokens


class NamespaceWatch:
    """The token index, its alarm and its files; thread-safe.

    Args:
        tracked_keys: token-only keys the index holds at most (10.25 bytes each).
        alarm_share: the share of recently missed blocks held under another namespace above
            which the store warns (``MismatchAlarm``).
        files: where the index is kept across restarts; ``None``: in memory only.
    """

    def __init__(
        self, tracked_keys: int, alarm_share: float = 0.5, files: TokenFiles | None = None
    ) -> None:
        self.index = TokenIndex(tracked_keys)
        self.alarm = MismatchAlarm(alarm_share, ALARM_MIN_LOOKUPS)
        self._files = files
        if files is not None:
            files.load_into(self.index)
        self._dirty = False
        self._last_save = time.monotonic()
        self._saving: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Bytes of the index's tables."""
        return self.index.nbytes

    def stored(
        self, descriptor: NamespaceDescriptor, token_ids: Sequence[int] | np.ndarray
    ) -> None:
        """Note that ``descriptor``'s namespace stored the full records of ``token_ids``.

        Args:
            descriptor: the storing namespace's parts.
            token_ids: the sequence's tokens from its start.
        """
        size = descriptor.record_tokens
        full = len(token_ids) // size * size
        keys = token_keys(token_ids[:full], grain(size))
        if keys and self.index.note(keys, descriptor):
            self._dirty = True
            self._maybe_save()

    def explain(
        self,
        asked: NamespaceDescriptor,
        token_ids: Sequence[int] | np.ndarray,
        miss_record: int,
        num_missed: int,
        cause: str,
    ) -> MissCause | None:
        """Count a lookup for the alarm, and tell whether its miss is a namespace mismatch.

        Args:
            asked: the looking-up namespace's parts.
            token_ids: the sequence's tokens from its start.
            miss_record: the index (from the sequence's start) of the first record not served.
            num_missed: records of the lookup not served, every cause.
            cause: the cause the store gave; only ``never_stored`` is looked into (the others
                are facts the store saw).

        Returns:
            The ``namespace_mismatch`` cause naming what differs, or ``None`` (the store's
            cause stands).
        """
        held = None
        step = grain(asked.record_tokens)
        end = miss_record * asked.record_tokens + step  # the miss record's first grain
        if cause == "never_stored" and num_missed and end <= len(token_ids):
            held = self.index.holder(token_keys(token_ids[:end], step)[-1], asked)
        self.alarm.observe(num_missed, num_missed if held else 0, asked, held)
        if held is None:
            return None
        return MissCause("namespace_mismatch", detail=asked.describe_difference(held))

    def save(self) -> None:
        """Write the index to its file now (nothing without files)."""
        if self._files is not None:
            self._dirty = False
            self._files.save(self.index)

    def close(self) -> None:
        """Wait for a save in flight, then save what is new."""
        with self._lock:
            saving = self._saving
        if saving is not None:
            saving.join()
        if self._dirty:
            self.save()

    def _maybe_save(self) -> None:
        if self._files is None or time.monotonic() - self._last_save < SAVE_INTERVAL_S:
            return
        with self._lock:
            if self._saving is not None and self._saving.is_alive():
                return
            self._last_save = time.monotonic()
            self._saving = threading.Thread(target=self.save, name="token-index-save", daemon=True)
            self._saving.start()
