"""Scenarios of the LMCache plugin, each run by ``test_lmcache_plugin`` as a fresh process of
``.venv-peers`` (where LMCache 0.5.6 lives); each prints one JSON line.

Every store is LMCache's own ``StorageManager`` with our plugin loaded through its
``storage_plugins`` mechanism (``benchmarks.peers.lmcache.PeerStore``), on CPU.

    .venv-peers/bin/python tests/connectors/lmcache_child.py <scenario> <work dir> [redis url]
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.peers.common import make_chunks  # noqa: E402
from benchmarks.peers.lmcache import PeerStore, byte_view, release  # noqa: E402
from benchmarks.plugins.lmcache import put_all  # noqa: E402

MODEL = "lmcache-plugin-test"
OPEN: list[PeerStore] = []  # closed by main: a StorageManager left open keeps the process alive


def store(work: Path, chunks: Any, **plugin: Any) -> PeerStore:
    settings = {"cpu_bytes": 0, "disk_path": str(work / "kv"), "model_fingerprint": MODEL}
    settings.update(plugin)
    worker = settings.pop("worker", (0, 1))
    side = PeerStore("cachetier", chunks, MODEL, plugin=settings, worker=worker)
    OPEN.append(side)
    return side


def close(side: PeerStore) -> None:
    """Close ``side`` now (a writer's lower tiers are flushed by its close)."""
    OPEN.remove(side)
    side.close()


def found_identical(side: PeerStore, chunks: Any) -> list[str]:
    """Per chunk: "same", "differs" or "miss", as a fresh StorageManager gets it."""
    got = side.get()
    try:
        return [
            "miss" if g is None else "same" if bytes(byte_view(g)) == want else "differs"
            for g, want in zip(got, chunks.payloads)
        ]
    finally:
        release(got)


def isolation(work: Path) -> dict[str, Any]:
    chunks = make_chunks("small", 4)
    writer = store(work, chunks)
    put_all(writer, chunks)
    close(writer)
    out = {"same": found_identical(store(work, chunks), chunks)}
    for name, change in {
        "other_model": {"model_fingerprint": "another-model"},
        "other_tenant": {"tenant": "another-tenant"},
        "other_worker": {"worker": (1, 2)},
    }.items():
        other = store(work, chunks, **change)
        out[name] = [other.count_found(), found_identical(other, chunks).count("same")]
        close(other)
    return out


def redis(work: Path, url: str, prefix: str) -> dict[str, Any]:
    chunks = make_chunks("small", 4)
    plugin = {"disk_path": None, "redis_url": url, "redis_key_prefix": prefix}
    writer = store(work, chunks, **plugin)
    put_all(writer, chunks)
    close(writer)
    reader = store(work, chunks, **plugin)
    return {"found": found_identical(reader, chunks)}


def corrupt(work: Path) -> dict[str, Any]:
    chunks = make_chunks("small", 3)
    writer = store(work, chunks)
    put_all(writer, chunks)
    close(writer)
    records = sorted((work / "kv").rglob("*.ctkv"))
    raw = bytearray(records[0].read_bytes())
    raw[-3] ^= 0xFF  # one payload byte: its checksum no longer matches
    records[0].write_bytes(raw)
    return {"found": found_identical(store(work, chunks), chunks)}


class Lines(logging.Handler):
    """Keeps the messages of the WARNINGs (and worse) it is given."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def corrupt_logged(work: Path) -> dict[str, Any]:
    """Two tampered chunks read one get each: what LMCache's lookups and gets say."""
    chunks = make_chunks("small", 3)
    writer = store(work, chunks)
    put_all(writer, chunks)
    close(writer)
    records = sorted((work / "kv").rglob("*.ctkv"))
    for record in records[:2]:
        raw = bytearray(record.read_bytes())
        raw[-3] ^= 0xFF  # one payload byte: its checksum no longer matches
        record.write_bytes(raw)
    reader = store(work, chunks)
    before = reader.count_found()
    catch = Lines()
    logging.getLogger("cachetier").addHandler(catch)
    found = found_identical(reader, chunks)
    logging.getLogger("cachetier").removeHandler(catch)
    lines = catch.lines
    return {
        "before": before,
        "found": found,
        "log": lines,
        "after": reader.count_found(),
        "tampered": sorted(r.stem[:16] for r in records[:2]),
    }


def start(work: Path, settings: str) -> dict[str, Any]:
    """Start LMCache with the plugin given ``settings`` (JSON); run as its own process
    (``starts``), whose logging is set up as an engine's would be."""
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    try:
        side = store(work, make_chunks("small", 1), **json.loads(settings))
    except RuntimeError as exc:  # PeerStore: LMCache started without the plugin
        return {"lmcache_started": True, "plugin": False, "why": str(exc)}
    return {"lmcache_started": True, "plugin": side.location in side.manager.storage_backends}


def starts(work: Path) -> dict[str, Any]:
    """Each bad config, in a process of its own: its exit status and its stderr."""
    cases = {
        "secret": {"remote_url": "http://127.0.0.1:9", "remote_token": "s3cret-0123456789"},
        "typo": {"disk_pth": str(work / "typo")},
        "no_fingerprint": {"model_fingerprint": None},
        "typo_not_fatal": {"disk_pth": str(work / "typo"), "fail_on_start_error": False},
        "good": {},
    }
    out = {}
    for name, settings in cases.items():
        done = subprocess.run(
            [sys.executable, __file__, "start", str(work / name), json.dumps(settings)],
            capture_output=True,
            text=True,
            timeout=300,
            env=os.environ,
            check=False,
        )
        last = done.stdout.strip().splitlines()[-1:] or ["null"]
        out[name] = {"rc": done.returncode, "stderr": done.stderr, "out": json.loads(last[0])}
    return out


def partial(work: Path) -> dict[str, Any]:
    """A chunk shorter than chunk_size (LMCache's last chunk of a prompt) is not stored."""
    import torch
    from lmcache.v1.memory_management import MemoryFormat

    chunks = make_chunks("small", 1)
    side = store(work, chunks)
    short = list(side.obj_shape)
    short[2] = 100
    obj = side.manager.allocate(torch.Size(short), torch.float16, fmt=MemoryFormat.KV_2LTD)
    obj.tensor.fill_(1.0)
    obj.ref_count_up()
    side.manager.batched_put(side.keys, [obj], location=side.location)
    stored = side.count_found()
    release([obj])
    return {"stored": stored, "files": len(list((work / "kv").rglob("*.ctkv")))}


def main() -> None:
    scenario, work = sys.argv[1], Path(sys.argv[2])
    if scenario == "isolation":
        result = isolation(work)
    elif scenario == "redis":
        result = redis(work, sys.argv[3], sys.argv[4])
    elif scenario == "corrupt":
        result = corrupt(work)
    elif scenario == "partial":
        result = partial(work)
    elif scenario == "corrupt_logged":
        result = corrupt_logged(work)
    elif scenario == "start":
        # A StorageManager that started without the plugin was never handed back (PeerStore
        # raised), and its event loop's thread would keep this process alive: exit at once.
        print(json.dumps(start(work, sys.argv[3]), sort_keys=True), flush=True)
        os._exit(0)
    elif scenario == "starts":
        result = starts(work)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    while OPEN:
        close(OPEN[-1])
    print(json.dumps(result, sort_keys=True))


if __name__ == "__main__":
    main()
