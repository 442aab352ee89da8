"""A ``TokenIndex`` kept in files across restarts, so a namespace mismatch is told after one.

The mismatch that matters most is the one a restart brings: a rolling upgrade starts pods of a
new build (another dtype, block size or record format) on the disk folder the old pods filled,
and every block misses. An index held only in memory would start empty in the new process and
call those misses ``never_stored``. So each process writes its index's entries to a file of its
own in a folder beside the data (``TokenFiles``), and a process that starts merges every file
there: the old build's entries say which tokens it held, and under what.

A file holds the entries (set, fingerprint, descriptor index: 18 bytes each) and the
descriptors as JSON. Several processes share the folder: each writes only its own file (a temp
file and a rename), so none reads a torn one; the oldest files past ``MAX_FILES`` are removed
by whoever writes next. A file that is unreadable, too large, of another version or table size
is skipped with one log line (the index then starts without it), never trusted.
"""

from __future__ import annotations

import io
import json
import logging
import os
import uuid
from pathlib import Path
from zipfile import BadZipFile

import numpy as np

from cachetier.misses.descriptor import NamespaceDescriptor
from cachetier.misses.token_index import TokenIndex

log = logging.getLogger("cachetier.misses")

VERSION = 1
FOLDER_NAME = ".cachetier-token-index"
"""The folder's name in a disk tier's folder (a dot name: the tier's scan passes it by)."""
SUFFIX = ".npz"
MAX_FILES = 16
MAX_FILE_BYTES = 64 << 20


class TokenFiles:
    """Where one process keeps its ``TokenIndex`` and finds the others'.

    Args:
        folder: the folder (created on the first save).
        file_mode: permission bits of the files this process writes.
    """

    def __init__(self, folder: str | os.PathLike[str], file_mode: int = 0o600) -> None:
        self.folder = Path(folder)
        self._file_mode = file_mode
        self.path = self.folder / f"{uuid.uuid4().hex}{SUFFIX}"

    def load_into(self, index: TokenIndex) -> int:
        """Merge every other process's file into ``index``.

        Returns:
            Entries merged.
        """
        merged = 0
        for path in self._files():
            if path == self.path:
                continue
            try:
                merged += index.merge(*_read(path, index.tracked_keys))
            except (OSError, ValueError, KeyError, TypeError, EOFError, BadZipFile) as exc:
                log.warning("token index file %s skipped: %s", path.name, exc)
        return merged

    def save(self, index: TokenIndex) -> None:
        """Write ``index``'s entries to this process's file (replacing it whole), and remove
        the oldest files past ``MAX_FILES``; a failure is logged, never raised (the index is
        a diagnosis, not data)."""
        rows, fps, ids, descriptors = index.entries()
        buf = io.BytesIO()
        meta = {"version": VERSION, "slots": index.tracked_keys, "descriptors": descriptors}
        np.savez(
            buf,
            rows=rows,
            fps=fps,
            ids=ids,
            meta=np.frombuffer(json.dumps(meta, default=_jsonable).encode(), dtype=np.uint8),
        )
        tmp = self.path.with_suffix(".tmp")
        try:
            self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, self._file_mode)
            with os.fdopen(fd, "wb") as f:
                f.write(buf.getbuffer())
            os.replace(tmp, self.path)
            self._prune()
        except OSError as exc:
            log.warning("token index not saved to %s: %s", self.folder, exc)

    def _files(self) -> list[Path]:
        """The folder's files, newest first."""
        try:
            entries = [p for p in self.folder.iterdir() if p.name.endswith(SUFFIX)]
        except OSError:
            return []
        timed = []
        for path in entries:
            try:
                timed.append((path.stat().st_mtime_ns, path))
            except OSError:
                continue  # removed by another process meanwhile
        return [path for _, path in sorted(timed, reverse=True)]

    def _prune(self) -> None:
        for path in self._files()[MAX_FILES:]:
            if path != self.path:
                path.unlink(missing_ok=True)


def _read(
    path: Path, slots: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[NamespaceDescriptor]]:
    if path.stat().st_size > MAX_FILE_BYTES:
        raise ValueError(f"larger than {MAX_FILE_BYTES} bytes")
    with np.load(path, allow_pickle=False) as data:
        meta = json.loads(bytes(data["meta"]).decode())
        if meta.get("version") != VERSION:
            raise ValueError(f"version {meta.get('version')!r}, not {VERSION}")
        if meta.get("slots") != slots:
            raise ValueError(f"written by an index of {meta.get('slots')} keys, not {slots}")
        descriptors = [_descriptor(d) for d in meta["descriptors"]]
        arrays = data["rows"], data["fps"], data["ids"]
        for array, dtype in zip(arrays, (np.uint64, np.uint64, np.uint16)):
            if array.dtype != dtype or array.ndim != 1:
                raise ValueError("entries of the wrong type")
        return *arrays, descriptors


def _jsonable(value: object) -> object:
    if isinstance(value, NamespaceDescriptor):
        return {name: getattr(value, name) for name in value.__dataclass_fields__}
    raise TypeError(f"{type(value).__name__} is not kept in a token index file")


def _descriptor(raw: object) -> NamespaceDescriptor:
    if not isinstance(raw, dict):
        raise ValueError("a descriptor is not an object")
    fields = dict(raw)
    fields["kv_shape"] = tuple(fields.get("kv_shape", ()))
    return NamespaceDescriptor(**fields)
