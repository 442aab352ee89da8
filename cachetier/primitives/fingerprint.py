"""The identity of a model folder: one sha256 hex digest over its config and its weights.

Two folders get the same fingerprint exactly when their config.json agrees on everything
that changes the math and their ``*.safetensors`` files hold the same bytes, in every process
and on every machine. It is what ``cachetier.primitives.keys.Namespace.model_fingerprint`` takes, so
KV blocks computed by one set of weights are never served to another.

    fingerprint = sha256(DOMAIN || len(config) || config
                         || for each weight file by name: len(name) || name || size || sha256(file))

Hashing every weight byte on each start would cost as much as reading the model once more, so
each file's digest is kept in ``.cachetier-fingerprint.json`` in the folder, keyed by (name,
size, mtime_ns): a file whose stat changed is hashed again. config.json is small and always
read afresh.

Our engine and every connector key blocks by it, so it lives in the core and needs only the
standard library: a connector gets it without importing torch or our engine.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

FINGERPRINT_CACHE_NAME = ".cachetier-fingerprint.json"

_DOMAIN = b"cachetier/model-fingerprint/v1\0"
_CACHE_VERSION = 1
_CHUNK_BYTES = 8 << 20  # 8 MiB: big enough for full hashing speed, small enough to stay lean
# Fields that record where or how a config was written, or the dtype it was loaded in (the
# stored dtype is in the weight bytes), but never what the model computes.
_IGNORED_CONFIG_KEYS = frozenset(
    {
        "transformers_version",
        "_name_or_path",
        "_model_name_or_path",
        "_commit_hash",
        "torch_dtype",
        "dtype",
    }
)


def model_fingerprint(folder: str | Path) -> str:
    """Return the fingerprint (64 lower-case hex digits) of a Hugging Face model folder.

    Args:
        folder: a folder with ``config.json`` and one or more ``*.safetensors`` files.

    Returns:
        The sha256 hex digest described in the module docstring.
    """
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{folder} has no config.json: pass a Hugging Face model folder")
    weight_paths = sorted(folder.glob("*.safetensors"), key=lambda p: p.name)
    if not weight_paths:
        raise ValueError(
            f"{folder} has no *.safetensors file: save the weights with safetensors first"
        )

    config = canonical_config(json.loads(config_path.read_text(encoding="utf-8")))
    cached = _read_cache(folder)
    entries: dict[str, dict[str, Any]] = {}
    digest = hashlib.sha256(_DOMAIN)
    digest.update(len(config).to_bytes(8, "little"))
    digest.update(config)
    for path in weight_paths:
        entry = _file_entry(path, cached.get(path.name))
        entries[path.name] = entry
        name = path.name.encode()
        digest.update(len(name).to_bytes(8, "little"))
        digest.update(name)
        digest.update(entry["size"].to_bytes(8, "little"))
        digest.update(bytes.fromhex(entry["sha256"]))
    if entries != cached:
        _maybe_write_cache(folder, entries)
    return digest.hexdigest()


def canonical_config(config: dict[str, Any]) -> bytes:
    """The bytes of a config dict that the fingerprint covers: sorted keys, compact, no noise.

    Args:
        config: a parsed config.json.

    Returns:
        Its canonical JSON, without the fields that only say where or how it was written.
    """
    if not isinstance(config, dict):
        raise TypeError(f"config must be a JSON object, got {type(config).__name__}")
    kept = {k: v for k, v in config.items() if k not in _IGNORED_CONFIG_KEYS}
    return json.dumps(kept, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _file_entry(path: Path, cached: dict[str, Any] | None) -> dict[str, Any]:
    before = path.stat()
    if (
        cached is not None
        and cached.get("size") == before.st_size
        and cached.get("mtime_ns") == before.st_mtime_ns
        and isinstance(cached.get("sha256"), str)
    ):
        return cached
    file_digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            file_digest.update(chunk)
    after = path.stat()
    if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
        raise RuntimeError(f"{path} changed while it was being hashed; call again once written")
    return {
        "size": before.st_size,
        "mtime_ns": before.st_mtime_ns,
        "sha256": file_digest.hexdigest(),
    }


def _read_cache(folder: Path) -> dict[str, dict[str, Any]]:
    # A missing, unreadable or foreign cache file is only a lost shortcut: hash again.
    try:
        data = json.loads((folder / FINGERPRINT_CACHE_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != _CACHE_VERSION:
        return {}
    files = data.get("files")
    if not isinstance(files, dict):
        return {}
    return {name: entry for name, entry in files.items() if isinstance(entry, dict)}


def _maybe_write_cache(folder: Path, entries: dict[str, dict[str, Any]]) -> None:
    payload = json.dumps({"version": _CACHE_VERSION, "files": entries}, indent=1, sort_keys=True)
    try:
        # Write aside and rename, so a concurrent reader sees the old file or the new, never half.
        fd, tmp = tempfile.mkstemp(prefix=FINGERPRINT_CACHE_NAME + ".", dir=folder)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(payload)
            os.replace(tmp, folder / FINGERPRINT_CACHE_NAME)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        # A read-only folder (a shared model store) still gets a fingerprint, just no cache.
        pass
