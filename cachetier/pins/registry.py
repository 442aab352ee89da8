"""The pins of a store, kept in one small JSON file so they survive a restart.

The file maps each storage namespace to its pinned keys (hex), in the order they were
pinned: ``{"version": 1, "pins": {"t.alice.<ns>": ["<64 hex>", ...]}}``. The sidecar's storage
namespaces carry the tenant (``t.<tenant>.``), so the file is namespaced per tenant by them.

Several processes may share the folder (pods of one node): every change is a read, modify and
write under an exclusive ``flock`` of ``<file>.lock``, and the write goes to a temp file that
is fsynced and renamed over the file, so a reader sees the old pins or the new, never half.
A file that is not a pin registry is refused with an error naming it rather than overwritten:
pins an operator set must not vanish silently.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from cachetier.errors import CacheTierError
from cachetier.primitives.keys import BlockHash, parse_key
from cachetier.tiers.base import check_namespace

REGISTRY_VERSION = 1
_MAX_FILE_BYTES = 64 << 20  # a million keys; pins are bounded by tier bytes long before this

Pins = dict[str, list[BlockHash]]
"""storage namespace -> pinned keys, in pin order."""


class PinRegistryError(CacheTierError):
    """The pin registry file cannot be read or written."""


class PinRegistry:
    """One pin registry file.

    Args:
        path: the file (its folder is created if missing).
        file_mode: permission bits of the file and its lock if this process creates them.
    """

    def __init__(self, path: str | os.PathLike[str], file_mode: int = 0o600) -> None:
        self.path = Path(path)
        self._file_mode = file_mode

    def load(self) -> Pins:
        """Every pin in the file (none if there is no file yet).

        Raises:
            PinRegistryError: the file is unreadable or not a pin registry.
        """
        with self._locked():
            return self._read()

    def add(self, namespace: str, keys: Sequence[BlockHash]) -> None:
        """Record pins (keys pinned already stay where they are)."""
        self._change(namespace, lambda old: list(dict.fromkeys([*old, *keys])))

    def remove(self, namespace: str, keys: Sequence[BlockHash]) -> None:
        """Forget pins."""
        gone = set(keys)
        self._change(namespace, lambda old: [k for k in old if k not in gone])

    def _change(self, namespace: str, edit: Callable[[list[BlockHash]], list[BlockHash]]) -> None:
        check_namespace(namespace)
        with self._locked():
            pins = self._read()
            keys = edit(pins.get(namespace, []))
            if keys:
                pins[namespace] = keys
            else:
                pins.pop(namespace, None)
            self._write(pins)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(
                f"{self.path}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, self._file_mode
            )
        except OSError as exc:
            raise PinRegistryError(f"cannot open the pin registry {self.path}: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    def _read(self) -> Pins:
        try:
            with open(self.path, "rb") as f:
                data = f.read(_MAX_FILE_BYTES + 1)
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise PinRegistryError(f"cannot read the pin registry {self.path}: {exc}") from exc
        if len(data) > _MAX_FILE_BYTES:
            raise PinRegistryError(f"the pin registry {self.path} is over {_MAX_FILE_BYTES} bytes")
        try:
            raw = json.loads(data)
            if raw.get("version") != REGISTRY_VERSION:
                raise ValueError(f"version {raw.get('version')!r}, not {REGISTRY_VERSION}")
            return {
                check_namespace(ns): [parse_key(k) for k in keys]
                for ns, keys in dict(raw["pins"]).items()
            }
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise PinRegistryError(
                f"the pin registry {self.path} is not readable ({str(exc)[:200]}); fix it or "
                "move it aside (its pins are then lost)"
            ) from None

    def _write(self, pins: Pins) -> None:
        body = {
            "version": REGISTRY_VERSION,
            "pins": {ns: [k.hex() for k in keys] for ns, keys in pins.items()},
        }
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, self._file_mode)
            try:
                view = memoryview(json.dumps(body, indent=1).encode())
                while view:  # a short write leaves the rest to write
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
            dir_fd = os.open(self.path.parent, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(dir_fd)  # the rename is durable once its folder is
            finally:
                os.close(dir_fd)
        except OSError as exc:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise PinRegistryError(f"cannot write the pin registry {self.path}: {exc}") from exc
