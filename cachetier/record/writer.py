"""Which process wrote a record: a writer id drawn at each process start.

Every record names its writer inside the checksummed part (format version 3), so the restore
guard can trust writers one by one: a new or buggy writer in a shared folder or sidecar is
verified on its first restored records even where other writers' records were verified before
(``cachetier.guard.records``). The id says nothing of the host or the prompt: 16 random bytes.
A forked child draws its own, since it is another process that may write differently.
"""

from __future__ import annotations

import os

WRITER_BYTES = 16
UNKNOWN_WRITER = bytes(WRITER_BYTES)
"""The writer of a record written before records named one (format versions 1 and 2)."""

_current = [os.urandom(WRITER_BYTES)]


def _renew() -> None:
    _current[0] = os.urandom(WRITER_BYTES)


os.register_at_fork(after_in_child=_renew)


def process_writer() -> bytes:
    """This process's writer id."""
    return _current[0]


def writer_of(writer: bytes | None) -> bytes:
    """A block's writer: its record's, or this process's for a block made here (``None``)."""
    return process_writer() if writer is None else writer


def writer_name(writer: bytes | None) -> str:
    """A writer id as the logs, the guard and the quarantines name it."""
    w = writer_of(writer)
    return "unknown" if w == UNKNOWN_WRITER else w.hex()[:16]


def start_new_writer() -> bytes:
    """Draw this process's writer id again, as a new process start would, and return it: for
    benchmarks and tests that stand for several processes (writers) in one."""
    _renew()
    return process_writer()
