"""The CUDA paths: canonical copies through the Triton kernel, pinned staging on a side stream,
our engine's pool on the GPU, and a real vLLM restart on CUDA.

Every test here is marked ``cuda``: without a CUDA device it is skipped (and reported as
skipped); ``make test-gpu`` runs them on a GPU machine. Everything they call that is not
CUDA-specific is the code the CPU tests run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from cachetier.connectors.vllm.layouts import CUDA_KV, VllmArrangement
from cachetier.connectors.vllm.paged import PagedKV
from cachetier.kernels.paged_layouts import PagedBlocks, axes_view
from cachetier.kernels.staging import HostStaging
from cachetier.primitives.keys import KVLayout

pytestmark = pytest.mark.cuda

ROOT = Path(__file__).resolve().parents[2]
L, NB, BS, H, D = 4, 64, 16, 2, 64


def _pages(device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"layer.{i}": torch.randn(NB, H, BS, 2 * D, generator=gen).to(device) for i in range(L)}


def _arrangement() -> VllmArrangement:
    return VllmArrangement(CUDA_KV, KVLayout("float32", BS, L, H, D))


def test_cuda_gather_and_write_match_the_cpu_path() -> None:
    cpu_pages = _pages("cpu")
    gpu_pages = {name: page.cuda() for name, page in cpu_pages.items()}
    cpu = PagedKV(cpu_pages, list(cpu_pages), _arrangement())
    gpu = PagedKV(gpu_pages, list(gpu_pages), _arrangement(), staging_bytes=1 << 20)
    ids = [5, 63, 0, 17, 5]
    want = cpu.gather(ids)
    got = gpu.gather(ids)
    assert all(g.device.type == "cpu" for g in got)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    gpu.write([1, 2], [w.numpy().tobytes() for w in want[:2]])
    cpu.write([1, 2], [w.numpy().tobytes() for w in want[:2]])
    for name in cpu_pages:
        assert torch.equal(gpu_pages[name].cpu(), cpu_pages[name])


def test_triton_copies_equal_torch_copies_on_cuda() -> None:
    pool = torch.randn(NB, L, 2, BS, H, D, device="cuda")
    axes = ("block", "layer", "kv", "token", "head", "dim")
    paged = PagedBlocks([[axes_view(pool, axes, block_size=BS, layer=i)] for i in range(L)])
    ids = torch.tensor([3, 9, 60], device="cuda")
    a = torch.empty(3, *paged.geometry.payload_shape, device="cuda")
    b = torch.empty_like(a)
    paged.gather(ids, a, backend="triton")
    paged.gather(ids, b, backend="torch")
    assert torch.equal(a, b)
    assert torch.equal(a, pool[ids.cpu()].cuda())


def test_staging_memory_is_bounded_and_reused() -> None:
    pages = _pages("cuda")
    views = [_arrangement().parts(page) for page in pages.values()]
    block_bytes = L * 2 * BS * H * D * 4
    staging = HostStaging(PagedBlocks(views), max_bytes=8 * block_bytes)
    reference = PagedKV({n: p.cpu() for n, p in pages.items()}, list(pages), _arrangement())
    for round_ in range(20):
        staging.save(list(range(round_, round_ + 6)), round_)
    saved = staging.drain()
    # A save larger than one pinned buffer comes back as several parts with its tag, in order;
    # none is lost while saves wait for a buffer, and every byte is the page's.
    tags = [p.tag for p in saved]
    assert tags == sorted(tags) and set(tags) == set(range(20))
    for round_ in range(20):
        got = [t for p in saved if p.tag == round_ for t in p.payloads]
        want = reference.gather(list(range(round_, round_ + 6)))
        assert len(got) == 6
        for g, w in zip(got, want):
            assert torch.equal(g.reshape(-1), w.reshape(-1))
    assert staging._allocated <= staging._num_buffers
    assert staging._allocated * staging._blocks_per_buffer * block_bytes <= 8 * block_bytes


def test_engine_pool_on_cuda_round_trips_blocks(tiny_model_dir: Path) -> None:
    from cachetier.engine.kv_cache import KVPool
    from cachetier.engine.model_spec import ModelSpec

    spec = ModelSpec.from_folder(tiny_model_dir)
    pool = KVPool(spec, 16, 8 << 20, "float32", device="cuda")
    assert pool.cache.device.type == "cuda"
    pool.cache.normal_()
    rows = pool.read_blocks([3, 1])
    pool.write_blocks([5, 6], rows)
    assert torch.equal(pool.cache[5], pool.cache[3])
    assert torch.equal(pool.cache[6], pool.cache[1])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn"])
def test_cuda_pool_restores_through_pinned_buffers_in_turn(
    tiny_model_dir: Path, dtype: str
) -> None:
    from cachetier.engine.kv_cache import KVPool
    from cachetier.engine.model_spec import ModelSpec

    spec = ModelSpec.from_folder(tiny_model_dir)
    probe = KVPool(spec, 16, 1 << 20, dtype)
    # One block per pinned buffer: seven blocks take the two buffers in turn, each reused
    # after its last copy has finished.
    pool = KVPool(spec, 16, 4 << 20, dtype, device="cuda", staging_bytes=2 * probe.block_bytes)
    gen = torch.Generator().manual_seed(1)
    # Bytes masked with 0x77: no NaN in any of the dtypes (the kernels copy floats, and the
    # blocks are compared as bytes).
    blocks = [
        (torch.randint(0, 256, (probe.block_bytes,), dtype=torch.uint8, generator=gen) & 0x77)
        .numpy()
        .tobytes()
        for _ in range(7)
    ]
    pool.write_blocks([9, 2, 4, 0, 11, 3, 7], blocks)
    assert len(pool._staging) == 2
    assert [bytes(row) for row in pool.read_blocks([9, 2, 4, 0, 11, 3, 7])] == blocks
    with pytest.raises(ValueError, match="not"):
        pool.write_blocks([1], [blocks[0][:-1]])


_VLLM_RUN = """
    import json, sys
    from vllm import LLM, SamplingParams
    from cachetier.connectors.vllm.launch import kv_transfer_config
    model, disk, prompt = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    llm = LLM(model=model, dtype="float32", enforce_eager=True, block_size=16,
              max_model_len=1024, gpu_memory_utilization=0.3,
              kv_transfer_config=kv_transfer_config({"cpu_bytes": 0, "disk_path": disk}))
    (out,) = llm.generate([{"prompt_token_ids": prompt}],
                          SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    print(json.dumps({"tokens": list(out.outputs[0].token_ids),
                      "cached": out.num_cached_tokens}))
"""


@pytest.mark.vllm
@pytest.mark.model
@pytest.mark.slow(reason="starts two vLLM processes on CUDA that each load SmolLM2")
def test_vllm_on_cuda_restarts_warm(tmp_path: Path, smollm2_dir: Path) -> None:
    prompt = list(range(1000, 1000 + 16 * 20 + 3))
    disk = tmp_path / "disk"
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = str(ROOT)

    def run() -> dict:
        proc = subprocess.run(
            [
                sys.executable,
                "-c",
                textwrap.dedent(_VLLM_RUN),
                str(smollm2_dir),
                str(disk),
                json.dumps(prompt),
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    cold, warm = run(), run()
    assert cold["cached"] == 0
    assert warm["cached"] == 20 * 16
    assert warm["tokens"] == cold["tokens"]
