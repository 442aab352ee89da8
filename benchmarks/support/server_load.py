"""The load test of ``benchmarks.server``: many clients doing mixed puts and gets, every read
checked against the payload its key first held.

Records are immutable: a key names its KV, so the server keeps the first record put under a
key and a later put of that key changes nothing (``docs/sidecar.md``). Each client owns its
keys (block keys of its own random tokens, in one shared namespace) and keeps, per key, the
payload variant of its first acknowledged put, with the variants of the puts before it that
were not acknowledged (one of those may have landed first). A get that misses an acknowledged
key is a lost block; one that returns a payload the key never could have held first is
corrupt. After the run the server is restarted (SIGTERM: it flushes) and every acknowledged key
is read back once more.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from cachetier.primitives.keys import BlockHash, KVLayout, Namespace, block_keys
from cachetier.record import KVBlock
from cachetier.tiers.remote import RemoteTier, RemoteTierConfig

NUM_VARIANTS = 16  # payloads a key may hold; a put picks one at random


@dataclass
class ClientResult:
    ops: int = 0
    puts: int = 0
    gets: int = 0
    bytes_moved: int = 0
    failed_puts: int = 0  # not acknowledged: the key may hold the old or the new payload
    lost_acknowledged: int = 0
    corrupt: int = 0
    errors: int = 0  # exceptions raised to the caller, plus the tier's counted errors
    acked: dict[bytes, int] = field(default_factory=dict)  # key -> first acknowledged variant
    # key -> variants it may hold: those sent up to its first acknowledged put (a put that was
    # not acknowledged may still have stored its record first)
    possible: dict[bytes, set[int]] = field(default_factory=dict)


class LoadClient:
    """One client: its own ``RemoteTier`` (own connections), keys and random stream."""

    def __init__(
        self, url: str, token: str, ns: Namespace, index: int, num_keys: int, payloads: list[bytes]
    ) -> None:
        self.tier = RemoteTier(RemoteTierConfig(url=url, token=token, timeout_s=30))
        self.ns = ns
        self.rng = random.Random(index)
        tokens = np.random.default_rng(10_000 + index).integers(0, 49_152, num_keys * 16)
        self.keys: list[BlockHash] = block_keys(ns, tokens)
        self.payloads = payloads
        self.result = ClientResult()

    def _block(self, key: BlockHash, variant: int) -> KVBlock:
        layout = self.ns.layout
        shape = (layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
        return KVBlock(key, self.ns.fingerprint, layout.dtype, shape, 16, self.payloads[variant])

    def step(self) -> None:
        r = self.result
        known = [k for k in self.keys if k in r.acked]
        if not known or self.rng.random() < 0.5:
            chosen = self.rng.sample(self.keys, self.rng.randint(1, 4))
            variants = [self.rng.randrange(NUM_VARIANTS) for _ in chosen]
            stored = self.tier.put_many(
                self.ns.id, [self._block(k, v) for k, v in zip(chosen, variants)]
            )
            r.puts += 1
            for key, variant in zip(chosen, variants):
                if key not in r.acked:  # once held, a key keeps its record: nothing to add
                    r.possible.setdefault(key, set()).add(variant)
            if stored == len(chosen):
                for key, variant in zip(chosen, variants):
                    r.acked.setdefault(key, variant)
            else:
                r.failed_puts += 1
            r.bytes_moved += len(chosen) * len(self.payloads[0])
        else:
            chosen = self.rng.sample(known, min(len(known), self.rng.randint(1, 8)))
            self.check(chosen)
            r.gets += 1
        r.ops += 1

    def check(self, keys: list[BlockHash]) -> None:
        """Read acknowledged ``keys`` and compare each with the payloads it may have held first."""
        r = self.result
        for key, got in zip(keys, self.tier.get_many(self.ns.id, keys)):
            if got is None:
                r.lost_acknowledged += 1
            elif not any(bytes(got.data) == self.payloads[v] for v in r.possible[key]):
                r.corrupt += 1
            else:
                r.bytes_moved += len(self.payloads[0])

    def run(self, stop_at: float) -> None:
        while time.monotonic() < stop_at:
            try:
                self.step()
            except Exception:  # noqa: BLE001 - counted: the serving path must never raise
                self.result.errors += 1

    def close(self) -> None:
        stats = self.tier.stats()
        self.result.errors += stats["errors"]
        self.result.corrupt += stats["corrupt"]
        self.tier.close()


def run_load(
    url: str, token: str, num_clients: int, seconds: float, num_keys: int
) -> list[LoadClient]:
    """Run ``num_clients`` clients on threads for ``seconds``; returns them (still open)."""
    layout = KVLayout("float16", block_size=16, num_layers=30, num_kv_heads=3, head_dim=64)
    ns = Namespace("bench-load-smollm2", layout)
    rng = np.random.default_rng(7)
    payloads = [
        rng.standard_normal(layout.block_bytes // 2, dtype=np.float32).astype(np.float16).tobytes()
        for _ in range(NUM_VARIANTS)
    ]
    clients = [LoadClient(url, token, ns, i, num_keys, payloads) for i in range(num_clients)]
    stop_at = time.monotonic() + seconds
    threads = [threading.Thread(target=c.run, args=(stop_at,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return clients


def verify_all(clients: list[LoadClient]) -> None:
    """Read back every acknowledged key of every client once (after a restart)."""
    for client in clients:
        keys = list(client.result.acked)
        for start in range(0, len(keys), 64):
            client.check(keys[start : start + 64])
