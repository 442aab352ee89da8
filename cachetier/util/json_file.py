"""A small JSON file replaced whole, so a reader sees the old document or the new, never half,
and read back within a bound."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def replace_json(path: Path, doc: Any, file_mode: int, fsync: bool = False) -> None:
    """Write ``doc`` to a temporary file beside ``path`` (never through a link), then rename
    it over ``path``; the temporary file is removed if anything fails.

    Args:
        path: the file to replace.
        doc: what to write (NaN and infinities are refused).
        file_mode: the new file's mode.
        fsync: flush the file to the disk before the rename.

    Raises:
        OSError: the file could not be written or renamed.
        ValueError: ``doc`` is not plain JSON.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW
        with os.fdopen(os.open(tmp, flags, file_mode), "w") as f:
            json.dump(doc, f, allow_nan=False)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, ValueError):
        tmp.unlink(missing_ok=True)
        raise


def read_json(path: Path, max_bytes: int) -> Any | None:
    """The document in ``path``, read no further than ``max_bytes``.

    Args:
        path: the file.
        max_bytes: the largest file read (a bigger one is not this program's).

    Returns:
        The parsed document; ``None`` if the file cannot be opened (missing, say).

    Raises:
        ValueError: the file is larger than ``max_bytes``, or is not JSON (too deep too).
    """
    try:
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError:
        return None
    if len(raw) > max_bytes:
        raise ValueError(f"larger than {max_bytes} bytes")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"not JSON ({exc})") from None
