"""Crashes: a writer, or the server it writes to, is killed with SIGKILL at random moments.

After every kill the tier is opened again (a restart) and must hold every block that was
acknowledged, intact, and never return a torn or foreign block for any key the writer touched;
its index must agree with the files on disk. Also: how long recovery takes for 100k blocks.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cachetier.primitives.keys import KVLayout, Namespace
from cachetier.record import KVBlock
from cachetier.tiers.disk.tier import SUFFIX, DiskTier, DiskTierConfig
from cachetier.tiers.remote import RemoteTier, RemoteTierConfig
from tests.faults.writer import CRASH_NAMESPACE, crash_blocks
from tests.server.live import TOKENS, ProcessServer
from tests.support import make_blocks

ROOT = Path(__file__).resolve().parents[2]
DISK_ROUNDS = 24
SERVER_ROUNDS = 6
BLOCKS_PER_ROUND = 400  # more than a writer gets through before its kill


class KilledWriter:
    """``tests.faults.writer`` in a child process, its acknowledgements collected as they come."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.faults.writer", *args],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        first = self.proc.stdout.readline().strip()
        assert first == "ready", f"the writer did not start: {first!r}"
        self.acked: list[int] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("ack "):
                self.acked.append(int(line.split()[1]))

    def kill(self) -> list[int]:
        """SIGKILL (a no-op if it already finished); the acknowledgements it printed."""
        self.proc.kill()
        self.proc.wait()
        self._reader.join(10)
        return list(self.acked)


def _same(got: KVBlock, want: KVBlock) -> bool:
    return (
        bytes(got.key) == bytes(want.key)
        and got.fingerprint == want.fingerprint
        and got.dtype == want.dtype
        and tuple(got.shape) == tuple(want.shape)
        and got.num_tokens == want.num_tokens
        and bytes(got.data) == bytes(want.data)
    )


class KillTally:
    """Acknowledged, lost and wrongly served blocks over a test's kill rounds."""

    def __init__(self, fault_figures) -> None:
        self.figures = fault_figures
        self.acked = self.lost = self.wrong = 0

    def round(self, got: list[KVBlock | None], blocks: list[KVBlock], acked: list[int]) -> None:
        """One round's reads after the restart, against the blocks the writer put."""
        lost = sum(1 for i in set(acked) if got[i] is None)
        wrong = sum(1 for b, want in zip(got, blocks) if b is not None and not _same(b, want))
        self.acked += len(acked)
        self.lost += lost
        self.wrong += wrong
        self.figures.add("kill_rounds")
        self.figures.add("acknowledged_lost", lost)
        self.figures.add("corrupt_served", wrong)

    def check(self) -> None:
        self.figures.add("acknowledged_blocks_checked", self.acked)
        assert (self.lost, self.wrong) == (0, 0)
        assert self.acked > 0, "no round acknowledged anything: the kills came too early"


def _files(root: Path) -> tuple[list[Path], list[Path]]:
    records, temps = [], []
    for dirpath, _, names in os.walk(root):
        for name in names:
            (temps if name.startswith(".tmp-") else records).append(Path(dirpath, name))
    return [p for p in records if p.name.endswith(SUFFIX)], temps


def test_killed_disk_writer_loses_no_acknowledged_block(tmp_path: Path, fault_figures) -> None:
    root = tmp_path / "disk"
    rng = random.Random(7)
    tally = KillTally(fault_figures)
    for seed in range(DISK_ROUNDS):
        writer = KilledWriter("disk", str(root), str(seed), str(BLOCKS_PER_ROUND))
        time.sleep(rng.uniform(0.02, 0.5))
        acked = writer.kill()
        # The restart: a new tier over the folder the killed process left behind.
        tier = DiskTier(DiskTierConfig(root=str(root), capacity_bytes=1 << 34))
        records, temps = _files(root)
        assert temps == [], "recovery must remove the temp files of interrupted writes"
        assert len(tier) == len(records)
        assert tier.used_bytes == sum(p.stat().st_size for p in records)
        blocks = crash_blocks(seed, BLOCKS_PER_ROUND)
        got = tier.get_many(CRASH_NAMESPACE.id, [b.key for b in blocks])
        tally.round(got, blocks, acked)
        tier.close()
    tally.check()


def test_killed_server_loses_no_acknowledged_block(tmp_path: Path, fault_figures) -> None:
    env = {
        "CACHETIER_TENANTS": f"alice:{TOKENS['alice']}",
        "CACHETIER_FSYNC": "true",
        "CACHETIER_CPU_BYTES": str(64 << 20),
    }
    args = ["--data-dir", str(tmp_path / "server")]
    rng = random.Random(11)
    tally = KillTally(fault_figures)
    for seed in range(SERVER_ROUNDS):
        server = ProcessServer(args, env).start()
        writer = KilledWriter(
            "remote",
            server.url,
            str(seed),
            str(BLOCKS_PER_ROUND),
            env={"CACHETIER_REMOTE_TOKEN": TOKENS["alice"]},
        )
        time.sleep(rng.uniform(0.3, 1.5))
        server.stop(signal.SIGKILL)
        acked = writer.kill()
        server = ProcessServer(args, env).start()
        client = RemoteTier(RemoteTierConfig(url=server.url, token=TOKENS["alice"]))
        blocks = crash_blocks(seed, BLOCKS_PER_ROUND)
        got = client.get_many(CRASH_NAMESPACE.id, [b.key for b in blocks])
        client.close()
        server.stop()
        tally.round(got, blocks, acked)
    tally.check()


@pytest.mark.slow(reason="writes 100,000 blocks to a disk tier and reopens it to recover them")
def test_recovery_time_of_100k_blocks(tmp_path: Path, fault_figures) -> None:
    # Tiny blocks: recovery walks the index (one scandir per shard), not the payloads.
    layout = KVLayout("float16", block_size=16, num_layers=1, num_kv_heads=1, head_dim=8)
    namespace = Namespace("recovery-test-model", layout)
    blocks = make_blocks(namespace, 100_000)
    config = DiskTierConfig(root=str(tmp_path / "disk"), capacity_bytes=1 << 34, fsync=False)
    with DiskTier(config) as tier:
        for start in range(0, len(blocks), 1000):
            assert tier.put_many(namespace.id, blocks[start : start + 1000]) == 1000
    with DiskTier(config) as tier:
        assert len(tier) == 100_000
        fault_figures.set("recovery_s_100k_blocks", round(tier.recovery_s, 3))
        probe = blocks[::9973]
        assert all(tier.get_many(namespace.id, [b.key for b in probe]))
