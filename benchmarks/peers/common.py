"""What both sides of ``benchmarks.peers`` share: the chunks, timing with checked reads, page cache.

Nothing here imports LMCache, so the pieces can be read (and tested) without it.
"""

from __future__ import annotations

import os
import resource
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cachetier.primitives.keys import KVLayout, Namespace, block_keys
from cachetier.record import KVBlock

CHUNK_TOKENS = 256  # LMCache's chunk_size; one of our blocks holds one chunk
SHAPES: dict[str, dict[str, int]] = {
    # SmolLM2-135M: 30 layers x K/V x 256 tokens x 3 KV heads x 64 dims, fp16 = 5.6 MiB
    "smollm2": dict(num_layers=30, num_kv_heads=3, head_dim=64),
    # a small model: 4 layers x K/V x 256 tokens x 2 KV heads x 64 dims, fp16 = 512 KiB
    "small": dict(num_layers=4, num_kv_heads=2, head_dim=64),
}


@dataclass(frozen=True, slots=True)
class ChunkSet:
    """``num_chunks`` chunks of one KV shape: the bytes both sides store and must give back.

    Args:
        name: the shape's name in ``SHAPES``.
        layout: our layout of one chunk (block_size = 256 tokens).
        namespace: our namespace of these chunks.
        blocks: our blocks; ``blocks[i].data`` is chunk i's payload (immutable bytes).
    """

    name: str
    layout: KVLayout
    namespace: Namespace
    blocks: tuple[KVBlock, ...]

    @property
    def payloads(self) -> list[bytes]:
        return [b.data for b in self.blocks]  # type: ignore[misc]

    @property
    def chunk_bytes(self) -> int:
        return self.layout.block_bytes

    @property
    def total_bytes(self) -> int:
        return self.chunk_bytes * len(self.blocks)

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """``[num_layers, 2, tokens, num_kv_heads, head_dim]`` of one chunk."""
        lay = self.layout
        return (lay.num_layers, 2, lay.block_size, lay.num_kv_heads, lay.head_dim)


def make_chunks(name: str, num_chunks: int, seed: int = 0) -> ChunkSet:
    """Random-normal fp16 chunks of shape ``SHAPES[name]``, keyed by our chained block keys."""
    layout = KVLayout("float16", block_size=CHUNK_TOKENS, **SHAPES[name])
    ns = Namespace(f"peers-{name}", layout)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 49_152, num_chunks * CHUNK_TOKENS)
    shape = (layout.num_layers, 2, CHUNK_TOKENS, layout.num_kv_heads, layout.head_dim)
    blocks = tuple(
        KVBlock(
            key,
            ns.fingerprint,
            "float16",
            shape,
            CHUNK_TOKENS,
            rng.standard_normal(shape, dtype=np.float32).astype(np.float16).tobytes(),
        )
        for key in block_keys(ns, tokens)
    )
    return ChunkSet(name, layout, ns, blocks)


class Destination:
    """One caller-owned buffer for a whole batch (a stand-in for a KV pool), pre-faulted.

    Both sides land their reads here in the "to a caller-owned buffer" measurements, so neither
    pays for fresh memory and both end with the same bytes in the same place.
    """

    def __init__(self, chunks: ChunkSet) -> None:
        self.array = np.zeros(chunks.total_bytes, dtype=np.uint8)  # [num_chunks * chunk_bytes]
        self.expected = np.frombuffer(b"".join(chunks.payloads), dtype=np.uint8)
        view = memoryview(self.array)
        n = chunks.chunk_bytes
        self.views = [view[i * n : (i + 1) * n] for i in range(len(chunks.blocks))]

    def scrub(self) -> None:
        """Overwrite the buffer so a read that did nothing cannot pass the check."""
        self.array.fill(0xA5)

    def check(self) -> None:
        if not np.array_equal(self.array, self.expected):
            bad = int(np.argmax(self.array != self.expected))
            raise AssertionError(f"bytes differ from what was stored, first at offset {bad}")


def check_buffers(got: Sequence[Any], payloads: Sequence[bytes], who: str) -> None:
    """Raise unless every returned buffer holds exactly its chunk's bytes."""
    if len(got) != len(payloads):
        raise AssertionError(f"{who}: {len(got)} results for {len(payloads)} chunks")
    for i, (buf, want) in enumerate(zip(got, payloads)):
        if buf is None:
            raise AssertionError(f"{who}: chunk {i} missed")
        if memoryview(buf).cast("B") != memoryview(want):
            raise AssertionError(f"{who}: chunk {i} came back with other bytes")


@dataclass
class Timed:
    """One measured operation.

    Args:
        op: the timed call; what it returns goes to ``check``.
        check: untimed; raises if the result is wrong (every sample is checked).
        before: untimed, before each sample (e.g. dropping the page cache).
    """

    op: Callable[[], Any]
    check: Callable[[Any], None] | None = None
    before: Callable[[], None] | None = None
    samples: list[float] = field(default_factory=list)


Meter = Callable[[str], float]
"""A count read just before and just after each op, given the op's name (e.g. CPU ns)."""


def _minor_faults(_: str) -> float:
    # Every thread's: LMCache reads disk chunks on a thread pool.
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)


def interleaved_checked(
    runs: dict[str, Timed],
    repeats: int,
    warmup: int = 1,
    meters: dict[str, Meter] | None = None,
) -> dict[str, Any]:
    """Median seconds of each op, run in turn (a, b, a, b, ...) so drift hits all alike.

    Unlike ``timing.interleaved_medians`` each result is checked after its clock stops, so
    checking every read costs no measured time. Around each op, outside its clock, every meter
    is read in order before and again after; the process's minor page faults are always one
    (``minflt``): an op that hands back fresh memory pays one per 4 KiB page it fills.

    Args:
        runs: the ops, by name.
        repeats: samples of each op kept.
        warmup: rounds run first and not kept (connections, pools and spares settle).
        meters: more counts to read around each op, by name.

    Returns:
        name -> median seconds, ``<name>_minflt`` -> median minor page faults per call,
        ``<name>_samples`` -> every sample's seconds in round order (rounds pair up across
        ops: ``timing.paired_ratio_interval``), and per other meter ``<name>_<meter>`` -> its
        growth over each sample, in the same order.
    """
    all_meters: dict[str, Meter] = {"minflt": _minor_faults, **(meters or {})}
    counts: dict[str, dict[str, list[float]]] = {name: {m: [] for m in all_meters} for name in runs}
    for i in range(warmup + repeats):
        for name, run in runs.items():
            if run.before is not None:
                run.before()
            before = [meter(name) for meter in all_meters.values()]
            start = time.perf_counter()
            result = run.op()
            elapsed = time.perf_counter() - start
            after = [meter(name) for meter in all_meters.values()]
            if run.check is not None:
                run.check(result)
            del result  # before the next op runs, as a caller done with it would
            if i >= warmup:
                run.samples.append(elapsed)
                for m, b, a in zip(all_meters, before, after, strict=True):
                    counts[name][m].append(a - b)
    out: dict[str, Any] = {name: statistics.median(run.samples) for name, run in runs.items()}
    for name, run in runs.items():
        out[f"{name}_minflt"] = int(statistics.median(counts[name].pop("minflt")))
        out[f"{name}_samples"] = list(run.samples)
        out.update({f"{name}_{m}": got for m, got in counts[name].items()})
    return out


def files_under(root: str | Path) -> list[Path]:
    """Every regular file below ``root``."""
    return [p for p in Path(root).rglob("*") if p.is_file()]


def drop_from_page_cache(paths: Iterable[Path]) -> None:
    """Make the kernel forget the cached pages of these files.

    Only clean pages can be dropped, so each file is written back (fsync) first.
    """
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_bytes(paths: Iterable[Path]) -> int:
    """Bytes of these files now in the page cache (mincore over a read-only mapping)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    page = mmap.PAGESIZE
    total = 0
    for path in paths:
        size = path.stat().st_size
        if not size:
            continue
        # A private mapping: writable as Python sees it (ctypes needs that), never written.
        with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as m:
            pages = (size + page - 1) // page
            vec = (ctypes.c_ubyte * pages)()
            first = ctypes.c_char.from_buffer(m)  # type: ignore[arg-type]
            rc = libc.mincore(ctypes.c_void_p(ctypes.addressof(first)), ctypes.c_size_t(size), vec)
            del first  # the mapping cannot close while a ctypes view holds it
            if rc != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            total += sum(v & 1 for v in vec) * page
    return total


def can_drop_all_caches() -> str:
    """Whether ``/proc/sys/vm/drop_caches`` may be written here (nothing is written)."""
    try:
        with open("/proc/sys/vm/drop_caches", "w"):
            pass
    except OSError as exc:
        return f"no ({exc.strerror})"
    return "yes (not used: the machine is shared; per-file fadvise is enough)"


def serve_raw(name: str, num_chunks: int, port: int) -> None:
    """Send the chunk set's bytes, back to back, for each byte a client sends (until EOF).

    Runs in a child process (``python -c``) as the floor of any TCP cache server: no protocol,
    no lookup, no checks, one ``sendall`` per chunk.
    """
    import socket

    payloads = make_chunks(name, num_chunks).payloads
    with socket.create_server(("127.0.0.1", port)) as server:
        conn, _ = server.accept()
        with conn:
            while conn.recv(1):
                for payload in payloads:
                    conn.sendall(payload)


def recv_exactly(sock: Any, dest: memoryview) -> None:
    """Fill ``dest`` from ``sock`` (``recv_into``: straight into the caller's buffer)."""
    got = 0
    while got < dest.nbytes:
        n = sock.recv_into(dest[got:])
        if not n:
            raise ConnectionError("the raw sender closed the connection early")
        got += n
