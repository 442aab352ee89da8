"""The Triton kernels and the connector's host copies on a CUDA device, against a baseline on
the same device in the same run.

Shapes are SmolLM2-135M's (30 layers, 3 KV heads, 9 query heads, head_dim 64, blocks of 16
tokens), bf16 in the pool and fp32 in vLLM's pages (the connector's host copies). Kernel ratios
are torch seconds / Triton seconds (> 1: Triton faster); copies also report GB/s against a
plain copy of the same bytes; host copies are a raw pinned copy's seconds / ours.

    python -m benchmarks.cuda_kernels --json

Without a CUDA device it prints why and exits with status 2: there is nothing to measure.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

os.environ.setdefault("TRITON_INTERPRET", "0")

import torch

from benchmarks.support.output import emit
from benchmarks.support.timing import interleaved_medians
from cachetier.connectors.vllm.layouts import CUDA_KV, VllmArrangement
from cachetier.connectors.vllm.paged import PagedKV
from cachetier.kernels import gather_blocks, paged_attention_decode, scatter_blocks
from cachetier.primitives.keys import KVLayout

LAYERS, KV_HEADS, GROUP, HEAD_DIM, BLOCK = 30, 3, 3, 64, 16


def _timed(fn: Callable[[], object], calls: int) -> Callable[[], None]:
    # One sample is `calls` launches then one sync: a per-launch sync would time the host.
    def run() -> None:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()

    return run


def copies(num_blocks: int, moved: int, repeats: int) -> dict[str, float]:
    pool = torch.randn(num_blocks, LAYERS, 2, BLOCK, KV_HEADS, HEAD_DIM, device="cuda")
    pool = pool.to(torch.bfloat16)
    ids = torch.randperm(num_blocks, device="cuda")[:moved]
    staging = torch.empty(moved, *pool.shape[1:], dtype=pool.dtype, device="cuda")
    flat_src = pool[:moved].clone()
    calls = 20

    def gather(backend: str) -> Callable[[], None]:
        return _timed(lambda: gather_blocks(pool, ids, staging, backend=backend), calls)

    def scatter(backend: str) -> Callable[[], None]:
        return _timed(lambda: scatter_blocks(staging, pool, ids, backend=backend), calls)

    t = interleaved_medians(
        {
            "gather_triton": gather("triton"),
            "gather_torch": gather("torch"),
            "scatter_triton": scatter("triton"),
            "scatter_torch": scatter("torch"),
            "plain_copy": _timed(lambda: staging.copy_(flat_src), calls),
        },
        repeats,
    )
    moved_bytes = 2 * staging.numel() * staging.element_size() * calls  # read + write
    return {
        "gather_triton_vs_torch": t["gather_torch"] / t["gather_triton"],
        "scatter_triton_vs_torch": t["scatter_torch"] / t["scatter_triton"],
        "gather_triton_vs_plain_copy": t["plain_copy"] / t["gather_triton"],
        "gather_triton_gbps": moved_bytes / t["gather_triton"] / 1e9,
        "plain_copy_gbps": moved_bytes / t["plain_copy"] / 1e9,
    }


def host_copies(num_blocks: int, moved: int, repeats: int) -> dict[str, float]:
    """The vLLM connector's CUDA saves (device pages -> own host tensors, through bounded pinned
    staging on a side stream) and loads (tier bytes -> pinned -> pages), against one raw
    pinned copy of the same bytes in the same direction."""
    layout = KVLayout("float32", BLOCK, LAYERS, KV_HEADS, HEAD_DIM)
    names = [f"layer.{i}" for i in range(LAYERS)]
    pages = {
        n: torch.randn(num_blocks, KV_HEADS, BLOCK, 2 * HEAD_DIM, device="cuda") for n in names
    }
    paged = PagedKV(pages, names, VllmArrangement(CUDA_KV, layout))
    ids = torch.randperm(num_blocks)[:moved].tolist()
    payloads = [p.numpy().tobytes() for p in paged.gather(ids)]
    nbytes = moved * layout.block_bytes
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    on_device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def save() -> None:
        paged.save(ids, None)
        paged.drain()

    def load() -> None:
        paged.write(ids, payloads)
        torch.cuda.synchronize()

    def raw(direction: str) -> Callable[[], None]:
        def run() -> None:
            if direction == "d2h":
                pinned.copy_(on_device, non_blocking=True)
            else:
                on_device.copy_(pinned, non_blocking=True)
            torch.cuda.synchronize()

        return run

    t = interleaved_medians(
        {"save": save, "raw_d2h": raw("d2h"), "load": load, "raw_h2d": raw("h2d")}, repeats
    )
    return {
        "d2h_save_vs_raw_copy": t["raw_d2h"] / t["save"],
        "h2d_load_vs_raw_copy": t["raw_h2d"] / t["load"],
        "raw_d2h_gbps": nbytes / t["raw_d2h"] / 1e9,
        "raw_h2d_gbps": nbytes / t["raw_h2d"] / 1e9,
    }


def decode(batch: int, context: int, shared_blocks: int, repeats: int) -> dict[str, float]:
    # Triton reads each row's blocks in place; rows that share leading blocks (the engine's
    # shared prefix) are timed too, since they hit the same pages in L2.
    blocks_per_seq = -(-context // BLOCK)
    own = blocks_per_seq - shared_blocks
    num_blocks = shared_blocks + batch * own + 1
    pool = torch.randn(num_blocks, 2, 2, BLOCK, KV_HEADS, HEAD_DIM, device="cuda")
    pool = pool.to(torch.bfloat16)
    order = torch.randperm(num_blocks - 1, device="cuda")
    shared = order[:shared_blocks]
    tables = torch.cat(
        [shared.expand(batch, -1), order[shared_blocks:].view(batch, own)], dim=1
    ).contiguous()
    lens = torch.full((batch,), context, device="cuda")
    query = torch.randn(batch, KV_HEADS * GROUP, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    scale = HEAD_DIM**-0.5

    def call(backend: str) -> Callable[[], object]:
        return lambda: paged_attention_decode(query, pool, 1, tables, lens, scale, backend=backend)

    t = interleaved_medians(
        {"triton": _timed(call("triton"), 10), "torch": _timed(call("torch"), 10)}, repeats
    )
    out = {"triton_vs_torch": t["torch"] / t["triton"]}
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * 2 * 10
    out["triton_kv_gbps"] = kv_bytes / t["triton"] / 1e9
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure", file=sys.stderr)
        sys.exit(2)
    result: dict[str, object] = {"device": torch.cuda.get_device_name()}
    result.update(copies(num_blocks=2048, moved=256, repeats=args.repeats))
    result.update(host_copies(num_blocks=512, moved=64, repeats=args.repeats))
    for batch, context in ((32, 1024), (64, 4096)):
        for key, value in decode(batch, context, 0, args.repeats).items():
            result[f"decode_{batch}x{context}_{key}"] = value
    for key, value in decode(64, 4096, 128, args.repeats).items():
        result[f"decode_shared2048_{key}"] = value
    emit(result, args.json)


if __name__ == "__main__":
    main()
