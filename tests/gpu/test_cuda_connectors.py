"""The connectors on CUDA tensors: HF transformers with its model on the GPU, blocks that cross
between a GPU and a CPU engine bit for bit through the disk tier, and vLLM's CUDA pages in the
dtypes and arrangements a GPU run uses (bf16, fp8, MLA latents) against the CPU path.

Marked ``cuda``: skipped, and reported as skipped, where no CUDA device exists. ``DEVICE`` is the
one name in here that is CUDA's: the code under test is the code the CPU tests run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from cachetier.connectors.hf import HFCacheConnector
from cachetier.connectors.vllm.layouts import CUDA_KV, MLA, VllmArrangement
from cachetier.connectors.vllm.paged import PagedKV
from cachetier.primitives.keys import KVLayout, dtype_name
from cachetier.primitives.kv_format import MLA_ARRANGEMENT
from cachetier.store.config import StoreConfig, build_store
from tests.models import ForwardTokens

pytestmark = pytest.mark.cuda

DEVICE = "cuda"
MiB = 1 << 20
BLOCK_SIZE = 16
NEW_TOKENS = 12


def _store_config(folder: Path, *, cpu_bytes: int) -> StoreConfig:
    return StoreConfig(cpu_bytes=cpu_bytes, disk_path=str(folder), disk_bytes=64 * MiB, fsync=False)


def _model(folder: Path, dtype: torch.dtype, device: str) -> torch.nn.Module:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype, local_files_only=True
    )
    return model.to(device).eval()


def _prompt(num_tokens: int, *, seed: int) -> list[int]:
    # Ids from 3 up: clear of the tiny model's bos (1) and eos (2).
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (num_tokens,), generator=generator).tolist()


def test_hf_connector_with_its_model_on_cuda_restores_instead_of_prefilling(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    model = _model(tiny_model_dir, torch.float32, DEVICE)
    tokens = _prompt(70, seed=1)
    prompt = torch.tensor([tokens], device=DEVICE)
    expected = model.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS, do_sample=False
    )
    with build_store(_store_config(tmp_path / "kv", cpu_bytes=16 * MiB)) as store:
        conn = HFCacheConnector(model, store, model_folder=tiny_model_dir, record_tokens=BLOCK_SIZE)
        cold, cold_info = conn.generate(tokens, max_new_tokens=NEW_TOKENS, do_sample=False)
        with ForwardTokens(model) as warm_forward:
            warm, warm_info = conn.generate(tokens, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert cold.device.type == warm.device.type == "cuda"
    assert torch.equal(cold, expected) and torch.equal(warm, expected)
    assert cold_info.num_saved_blocks == 4 and cold_info.num_cached_tokens == 0
    assert warm_info.num_cached_tokens == 64 and warm_info.cached_tokens_by_source == {"cpu": 64}
    assert warm_forward.lengths[0] == 70 - 64  # the GPU model prefilled only the tail
    assert conn.stats.restored_blocks == 4 and conn.stats.rejected_blocks == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("saver", ["cuda", "cpu"])
def test_blocks_cross_between_a_gpu_and_a_cpu_model_bit_for_bit(
    tiny_model_dir: Path, tmp_path: Path, dtype: torch.dtype, saver: str
) -> None:
    """One model saves its KV to disk; the same weights on the other device restore it from a
    fresh store over that folder, every bit as the saver computed it."""
    loader = "cpu" if saver == DEVICE else DEVICE
    tokens = _prompt(40, seed=13)
    source = _model(tiny_model_dir, dtype, saver)
    cache = transformers.DynamicCache(config=source.config)
    with torch.no_grad():
        source(torch.tensor([tokens], device=saver), past_key_values=cache, use_cache=True)
    with build_store(_store_config(tmp_path / "kv", cpu_bytes=0)) as store:
        assert HFCacheConnector(source, store, model_folder=tiny_model_dir).save(tokens, cache) == 2

    target = _model(tiny_model_dir, dtype, loader)
    with build_store(_store_config(tmp_path / "kv", cpu_bytes=0)) as store:
        conn = HFCacheConnector(target, store, model_folder=tiny_model_dir)
        restored, num_cached = conn.restore(tokens)
    assert num_cached == 32 and restored is not None
    assert conn.stats.restored_by_tier == {"disk": 2}
    for ours, theirs in zip(restored.layers, cache.layers, strict=True):
        assert ours.keys.device.type == loader and ours.keys.dtype == dtype
        assert torch.equal(ours.keys.cpu(), theirs.keys[:, :, :32].cpu())
        assert torch.equal(ours.values.cpu(), theirs.values[:, :, :32].cpu())


L, NB, BS = 3, 40, 16


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bits as uint8 (fp8 and NaN-safe: equal bytes, not equal values)."""
    return t.contiguous().view(torch.uint8)


def _random_pages(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    # Random bytes viewed as the dtype: every bit pattern, NaNs and fp8 included, must survive.
    gen = torch.Generator().manual_seed(seed)
    nbytes = torch.empty(0, dtype=dtype).element_size()
    return [
        torch.randint(
            0, 256, (*shape[:-1], shape[-1] * nbytes), generator=gen, dtype=torch.uint8
        ).view(dtype)
        for _ in range(L)
    ]


@pytest.mark.parametrize(
    ("kind", "dtype", "heads", "dim"),
    [
        (CUDA_KV, torch.bfloat16, 8, 128),
        (CUDA_KV, torch.float16, 2, 64),
        (CUDA_KV, torch.float8_e4m3fn, 4, 128),
        (MLA, torch.bfloat16, 1, 576),  # DeepSeek's latent: kv_lora_rank 512 + rope dim 64
        (MLA, torch.float8_e4m3fn, 1, 576),
    ],
)
def test_vllm_cuda_pages_copy_like_the_cpu_path(
    kind: str, dtype: torch.dtype, heads: int, dim: int
) -> None:
    """The worker's gather (pages -> pinned host payloads) and write (payloads -> pages) on the
    GPU give the bytes the CPU path gives for the same pages, in every dtype and arrangement."""
    if kind == MLA:
        arrangement = VllmArrangement(
            MLA, KVLayout(dtype_name(dtype), BS, L, 1, dim, arrangement=MLA_ARRANGEMENT)
        )
        shape: tuple[int, ...] = (NB, BS, dim)
    else:
        arrangement = VllmArrangement(CUDA_KV, KVLayout(dtype_name(dtype), BS, L, heads, dim))
        shape = (NB, heads, BS, 2 * dim)
    names = [f"layer.{i}" for i in range(L)]
    cpu_pages = dict(zip(names, _random_pages(shape, dtype, seed=3), strict=True))
    gpu_pages = {name: page.to(DEVICE) for name, page in cpu_pages.items()}
    cpu = PagedKV(cpu_pages, names, arrangement)
    gpu = PagedKV(gpu_pages, names, arrangement, staging_bytes=4 * arrangement.layout.block_bytes)
    assert gpu.device.type == "cuda"

    ids = [7, NB - 1, 0, 21, 7, 3]  # more blocks than one pinned buffer holds, one twice
    want, got = cpu.gather(ids), gpu.gather(ids)
    assert len(got) == len(ids) and all(g.device.type == "cpu" for g in got)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(_bytes(g), _bytes(w))

    # Write blocks 0 and 21's payloads over 30 and 31 on both sides: the pages agree byte for byte.
    payloads = [_bytes(w).numpy().tobytes() for w in want[2:4]]
    # Each write returns what its copy took, to the copy's end: the pages are already whole.
    assert gpu.write([30, 31], payloads) > 0
    assert cpu.write([30, 31], payloads) > 0
    for name in names:
        assert torch.equal(_bytes(gpu_pages[name].cpu()), _bytes(cpu_pages[name]))
    assert torch.equal(_bytes(cpu_pages[names[0]][30]), _bytes(cpu_pages[names[0]][0]))
