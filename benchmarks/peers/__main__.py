"""Side by side with LMCache 0.5.6 on this machine: the same KV chunks through its storage layer
and through our tiers, in one run, and the chunks each finds after a restart.

Chunks: 256 tokens (LMCache's chunk_size) of fp16 KV, random-normal, in two shapes: SmolLM2-135M
(30 layers, 3 KV heads, 64 dims: 5.6 MiB) and a small model (4 layers, 2 KV heads, 64 dims:
512 KiB). Each measurement runs in a fresh process that holds both sides and alternates between
them (ours, LMCache, ours, ...) so drift hits both; every read is compared byte for byte with
what was stored, after its clock stops. Ratios are ours over LMCache in speed (LMCache's median
time / ours); > 1 means we are faster. ``benchmarks.peers.sections`` says exactly what each
timed op does.

    make bench-peers     # creates .venv-peers (LMCache + cachetier in one env), then runs:
    .venv-peers/bin/python -m benchmarks.peers --json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.peers.common import SHAPES, can_drop_all_caches, make_chunks
from benchmarks.support.children import REPO_ROOT, module_command
from benchmarks.support.output import emit
from benchmarks.support.timing import paired_ratio_interval
from benchmarks.support.workdir import disk_work_dir

TIERS = ("cpu", "disk", "redis", "server")
SECTIONS = [f"{tier}:{shape}" for tier in TIERS for shape in SHAPES] + [
    "restart:disk-write",
    "restart:disk-read",
    "restart:server",
]
MODES = {  # what one timed get does; benchmarks.peers.sections says it in full
    "buf": "the batch landed in one caller-owned, pre-faulted buffer (a KV pool)",
    "ret": "the batch as each API returns it (ours: KVBlocks; LMCache: MemoryObjs of its pool)",
    "one": "as ret, one chunk per call",
}


def run_section(section: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One measurement in this (child) process; LMCache is imported only here."""
    from benchmarks.peers import restart, sections

    kind, _, what = section.partition(":")
    if kind == "restart":
        sets = [make_chunks(shape, args.chunks) for shape in SHAPES]
        root = work / "restart"
        if what == "disk-write":
            return restart.write_disk(sets, root)
        if what == "disk-read":
            return restart.read_disk(sets, root)
        return restart.restart_servers(sets, root)
    chunks = make_chunks(what, args.chunks)
    tmp = Path(tempfile.mkdtemp(dir=work, prefix=f"{kind}-{what}-"))
    if kind == "cpu":
        return sections.bench_cpu(chunks, args.repeats)
    if kind == "disk":
        return sections.bench_disk(chunks, args.repeats, tmp)
    if kind == "redis":
        return sections.bench_redis(chunks, args.repeats, args.redis_url)
    if kind == "server":
        return sections.bench_server(chunks, args.repeats, tmp)
    raise ValueError(f"unknown section {section!r}")


def figures(raw: dict[str, dict[str, Any]]) -> dict[str, tuple[str, str, str]]:
    """Every ours-over-LMCache figure (``<tier>_get_<mode>_<shape>`` and the puts): its name ->
    (section, LMCache's op, ours), two ops timed in turn in that section."""
    out: dict[str, tuple[str, str, str]] = {}
    for tier in TIERS:
        for shape in SHAPES:
            section = f"{tier}:{shape}"
            t = raw[section]
            for suffix in ("", "_cold") if tier == "disk" else ("",):
                for mode in MODES:
                    name = f"{tier}{suffix}_get_{mode}_{shape}"
                    out[name] = (section, f"lmcache_get_{mode}{suffix}", f"ours_get_{mode}{suffix}")
            if "ours_put" in t:
                # The durable puts ran in a group of their own (sections.bench_server).
                durable = "lmcache_put_durable_group"
                theirs = durable if durable in t else "lmcache_put"
                out[f"{tier}_put_{shape}"] = (section, theirs, "ours_put")
            if "ours_put_memonly" in t:
                out[f"server_put_memonly_{shape}"] = (section, "lmcache_put", "ours_put_memonly")
            if tier == "server":  # ours over the Unix socket it offers same-host engines
                for mode in ("buf", "ret"):
                    out[f"server_unix_get_{mode}_{shape}"] = (
                        section,
                        f"lmcache_get_{mode}",
                        f"ours_unix_get_{mode}",
                    )
                out[f"server_unix_put_memonly_{shape}"] = (
                    section,
                    "lmcache_put",
                    "ours_unix_put_memonly",
                )
    return out


def speedups(raw: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Every figure's ratio: LMCache's median time over ours."""
    return {
        name: raw[section][theirs] / raw[section][ours]
        for name, (section, theirs, ours) in figures(raw).items()
    }


def intervals(raw: dict[str, dict[str, Any]]) -> dict[str, tuple[float, float]]:
    """Every figure's 95% interval: that of the median of its per-round ratios (LMCache's time
    over ours in the same round)."""
    out: dict[str, tuple[float, float]] = {}
    for name, (section, theirs, ours) in figures(raw).items():
        t = raw[section]
        low, _, high = paired_ratio_interval(t[f"{theirs}_samples"], t[f"{ours}_samples"])
        out[name] = (round(low, 3), round(high, 3))
    return out


def bounds(raw: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Same-run bounds: the speedup over LMCache that the bare operation under each tier reaches
    on one thread and one stream (``*_ceiling``: ours passes one only by using more threads or
    streams), and ours against the bare operation."""
    out: dict[str, float] = {}
    for shape in SHAPES:
        disk, red, srv = raw[f"disk:{shape}"], raw[f"redis:{shape}"], raw[f"server:{shape}"]
        cpu = raw[f"cpu:{shape}"]
        out[f"cpu_get_ceiling_{shape}"] = cpu["lmcache_get_buf"] / cpu["raw_copy_get_buf"]
        for suffix in ("", "_cold"):
            out[f"disk{suffix}_get_ceiling_{shape}"] = (
                disk[f"lmcache_get_buf{suffix}"] / disk[f"raw_readinto_get_buf{suffix}"]
            )
        out[f"redis_get_ceiling_{shape}"] = red["lmcache_get_buf"] / red["raw_pipeline_get_ret"]
        out[f"redis_get_sockets_ceiling_{shape}"] = (
            red["lmcache_get_buf"] / red["raw_sockets_get_buf"]
        )
        out[f"redis_put_ceiling_{shape}"] = red["lmcache_put"] / red["raw_pipeline_put"]
        out[f"server_get_ceiling_{shape}"] = srv["lmcache_get_buf"] / srv["raw_tcp_get_buf"]
        out[f"server_ours_get_vs_raw_tcp_{shape}"] = srv["raw_tcp_get_buf"] / srv["ours_get_buf"]
        out[f"server_put_durable_ceiling_{shape}"] = (
            srv["lmcache_put_durable_group"] / srv["raw_write_put"]
        )
        out[f"redis_ours_get_vs_raw_pipeline_{shape}"] = (
            red["raw_pipeline_get_ret"] / red["ours_get_ret"]
        )
        for suffix in ("", "_cold"):
            out[f"disk{suffix}_ours_get_ret_vs_raw_read_{shape}"] = (
                disk[f"raw_read_get_ret{suffix}"] / disk[f"ours_get_ret{suffix}"]
            )
    return {k: round(v, 3) for k, v in out.items()}


def headline(
    ratios: dict[str, float], raw: dict[str, dict[str, Any]]
) -> tuple[dict[str, Any], dict[str, str]]:
    """The issue's figures: each is the lower of the two shapes (we must hold at both). Also,
    per ``*_speedup`` figure, the ratio it took (``figures``' name, shape included)."""
    out: dict[str, Any] = {}
    taken: dict[str, str] = {}

    def worst(figure: str, prefix: str) -> None:
        name = min((f"{prefix}_{shape}" for shape in SHAPES), key=ratios.__getitem__)
        out[figure] = round(ratios[name], 3)
        taken[figure] = name

    for tier in ("cpu", "disk", "disk_cold", "redis", "server"):
        worst(f"{tier}_get_speedup", f"{tier}_get_buf")
    worst("redis_put_speedup", "redis_put")
    # Like for like: LMCache's server holds puts in memory only, so does ours here. With its
    # disk tier ours answers only after the disk write (durable): reported apart.
    worst("server_put_speedup", "server_put_memonly")
    worst("server_put_durable_speedup", "server_put")
    # Over the Unix socket our sidecar offers engines on its host (LMCache's lm:// has none).
    worst("server_get_unix_socket_speedup", "server_unix_get_buf")
    worst("server_put_unix_socket_speedup", "server_unix_put_memonly")
    for tier in ("cpu", "disk", "disk_cold", "redis", "server"):
        worst(f"{tier}_get_as_returned_speedup", f"{tier}_get_ret")
        worst(f"{tier}_get_one_chunk_speedup", f"{tier}_get_one")
    disk = raw["restart:disk-read"]
    server = raw["restart:server"]
    out["chunks"] = raw["restart:disk-write"]["stored"]
    # The fewer of the two restarts (disk tier, server process); both are also given.
    out["ours_found_after_restart"] = min(disk["ours_disk_found"], server["ours_server_found"])
    out["lmcache_found_after_restart"] = min(
        disk["lmcache_disk_found"], server["lmcache_server_found"]
    )
    out["ours_disk_found_after_restart"] = disk["ours_disk_found"]
    out["lmcache_disk_found_after_restart"] = disk["lmcache_disk_found"]
    out["lmcache_disk_files_after_restart"] = disk["lmcache_disk_files"]
    out["ours_server_found_after_restart"] = server["ours_server_found"]
    out["lmcache_server_found_after_restart"] = server["lmcache_server_found"]
    return out, taken


def table(raw: dict[str, dict[str, Any]], num_chunks: int) -> str:
    """Absolute medians, ms per batch of ``num_chunks`` chunks, LMCache / ours, and the 95%
    interval of the per-round ratio's median (``paired_ratio_interval``)."""
    lines = [
        f"{'tier:shape':<14} {'op':<22} {'ours ms':>9} {'LMCache ms':>11} {'ratio':>6} "
        f"{'95% interval':>13}"
    ]
    for section, t in raw.items():
        if section.startswith("restart"):
            continue
        for name, ours in sorted(t.items()):
            if not isinstance(ours, float) or name.startswith("lmcache_"):
                continue
            op = name.removeprefix("ours_")
            if name.startswith("raw_"):  # a bound, against LMCache's op of the same kind
                theirs_op = name.split("_", 2)[2]  # raw_<what>_<op>
                op = f"bound: {op.removeprefix('raw_')}"
            else:  # ours_put_memonly is against LMCache's (memory-only) put
                theirs_op = op.removesuffix("_memonly").removeprefix("unix_")
            if theirs_op == "put" and name in ("ours_put", "raw_write_put"):
                # The durable puts ran in a group of their own (sections.bench_server).
                theirs_op = "put_durable_group" if "lmcache_put_durable_group" in t else "put"
            theirs = t[f"lmcache_{theirs_op}"]
            low, _, high = paired_ratio_interval(
                t[f"lmcache_{theirs_op}_samples"], t[f"{name}_samples"]
            )
            lines.append(
                f"{section:<14} {op:<22} {1e3 * ours:>9.2f} {1e3 * theirs:>11.2f} "
                f"{theirs / ours:>6.2f} {f'{low:.2f}-{high:.2f}':>13}"
            )
    lines.append(f"(one batch = {num_chunks} chunks; ratio > 1: ours (or the bound) is faster)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.add_argument("--chunks", type=int, default=16, help="chunks per shape")
    parser.add_argument("--repeats", type=int, default=15, help="samples per op (CPU: 4x)")
    parser.add_argument(
        "--redis-url", default=os.environ.get("CACHETIER_REDIS_URL", "redis://127.0.0.1:6379/0")
    )
    parser.add_argument("--data-dir", default=None, help="parent of the temp folders")
    parser.add_argument("--section", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--work", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if importlib.util.find_spec("lmcache") is None:
        sys.exit("LMCache is not installed in this environment: run `make bench-peers`")
    if args.section:  # a child run: one section, its figures as JSON
        print(json.dumps(run_section(args.section, args, Path(args.work))))
        os._exit(0)  # LMCache leaves non-daemon threads behind; the figures are out
    raw: dict[str, dict[str, Any]] = {}
    work_parent = disk_work_dir(args.data_dir, "--data-dir")
    with tempfile.TemporaryDirectory(dir=work_parent, prefix="bench-peers-") as work:
        for section in SECTIONS:
            print(f"benchmarks.peers: {section} ...", file=sys.stderr, flush=True)
            cmd = module_command("benchmarks.peers", "--section", section, "--work", work)
            cmd += ["--chunks", str(args.chunks), "--repeats", str(args.repeats)]
            cmd += ["--redis-url", args.redis_url]
            env = {**os.environ, "LMCACHE_TRACK_USAGE": "false"}
            out = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, env=env)
            if out.returncode != 0:
                sys.exit(f"benchmarks.peers: section {section} failed:\n{out.stderr[-4000:]}")
            raw[section] = json.loads(out.stdout.strip().splitlines()[-1])
    ratios = speedups(raw)
    cis = intervals(raw)
    result, taken = headline(ratios, raw)
    result.update(
        {
            "chunks_per_shape": args.chunks,
            "chunk_bytes": {s: make_chunks(s, 1).chunk_bytes for s in SHAPES},
            "repeats": args.repeats,
            "lmcache_version": _version("lmcache"),
            # Every record we move is checksummed with it; its speed moves the disk ratios.
            "xxhash_version": _version("xxhash"),
            "headline": "min over the two shapes of the get into a caller-owned buffer",
            "modes": MODES,
            "disk_cold_method": "page cache dropped per file (fsync + posix_fadvise "
            "DONTNEED) before each sample; resident bytes after the drop: "
            + str(max(raw[f"disk:{s}"]["resident_bytes_after_drop"] for s in SHAPES)),
            "drop_caches_writable": can_drop_all_caches(),
            "ratios": {k: round(v, 3) for k, v in ratios.items()},
            # Per headline figure, the interval of the ratio it took: one whose interval holds
            # 1.0 is not told apart from LMCache by this run.
            "intervals_95": {figure: cis[name] for figure, name in taken.items()},
            "ratio_intervals_95": cis,
            "bounds": bounds(raw),
            "minor_faults_per_batch": {
                sec: {k.removesuffix("_minflt"): v for k, v in t.items() if k.endswith("_minflt")}
                for sec, t in raw.items()
            },
            "medians_ms": {
                sec: {k: round(1e3 * v, 3) for k, v in t.items() if isinstance(v, float)}
                for sec, t in raw.items()
            },
        }
    )
    print(table(raw, args.chunks), file=sys.stderr if args.json else sys.stdout)
    emit(result, args.json)


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


if __name__ == "__main__":
    main()
