"""Greedy output with a restored prefix (pool, CPU, disk, Redis, a restarted process) equals
output computed from scratch; blocks of another model, dtype or record size are never used."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cachetier.engine.llm import LLM
from cachetier.engine.sampling import SamplingParams
from cachetier.store.config import StoreConfig, build_store
from cachetier.store.tiered import TieredStore
from cachetier.tiers.redis import RedisTier, RedisTierConfig
from tests.models import make_tiny_llama

GREEDY = SamplingParams(temperature=0, max_tokens=12)
TINY_BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # layers x K/V x tokens x KV heads x head_dim x fp32
PROMPT = [(i * 7 + 3) % 250 for i in range(150)]  # 9 full blocks of 16 and a partial one


def reference(model: Path, prompts: list[list[int]], **kw: object) -> list[list[int]]:
    llm = LLM(model, enable_prefix_caching=False, kv_cache_bytes=4 << 20, **kw)
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


def test_pool_prefix_hit_gives_the_same_tokens(tiny_model_dir: Path) -> None:
    prompts = [PROMPT, PROMPT[:100] + [5, 6, 7] * 20]
    llm = LLM(tiny_model_dir, kv_cache_bytes=4 << 20)
    first = llm.generate([prompts[0]], GREEDY)[0]
    second = llm.generate([prompts[1]], GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 96 and second.cached_tokens_by_source == {"pool": 96}
    assert [first.token_ids, second.token_ids] == reference(tiny_model_dir, prompts)


def test_cpu_tier_restore_after_the_pool_forgot(tiny_model_dir: Path) -> None:
    store = build_store(StoreConfig(cpu_bytes=64 << 20))
    llm = LLM(tiny_model_dir, store=store, kv_cache_bytes=4 << 20, guard=False)
    llm.generate([PROMPT], GREEDY)
    assert llm.engine.blocks.clear_cache() > 0
    again = llm.generate([PROMPT], GREEDY)[0]
    assert again.cached_tokens_by_source == {"cpu": 144}
    assert again.token_ids == reference(tiny_model_dir, [PROMPT])[0]
    store.close()


def test_disk_tier_restore_in_a_new_engine(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = StoreConfig(cpu_bytes=64 << 20, disk_path=str(tmp_path / "disk"), fsync=False)
    with LLM(tiny_model_dir, store=config, kv_cache_bytes=4 << 20, guard=False) as llm:
        llm.generate([PROMPT], GREEDY)
    with LLM(tiny_model_dir, store=config, kv_cache_bytes=4 << 20, guard=False) as llm:
        out = llm.generate([PROMPT + [1, 2, 3]], GREEDY)[0]
    assert out.cached_tokens_by_source == {"disk": 144}
    assert out.token_ids == reference(tiny_model_dir, [PROMPT + [1, 2, 3]])[0]


def test_redis_tier_restore_in_a_new_engine(
    tiny_model_dir: Path, redis_url: str, redis_prefix: str
) -> None:
    def store() -> TieredStore:
        return TieredStore([RedisTier(RedisTierConfig(url=redis_url, key_prefix=redis_prefix))])

    first = store()
    LLM(tiny_model_dir, store=first, kv_cache_bytes=4 << 20, guard=False).generate([PROMPT], GREEDY)
    first.close()
    second = store()
    out = LLM(tiny_model_dir, store=second, kv_cache_bytes=4 << 20, guard=False).generate(
        [PROMPT], GREEDY
    )[0]
    second.close()
    assert out.cached_tokens_by_source == {"redis": 144}
    assert out.token_ids == reference(tiny_model_dir, [PROMPT])[0]


def test_evicted_blocks_reach_the_tier_and_come_back(tiny_model_dir: Path) -> None:
    store = build_store(StoreConfig(cpu_bytes=64 << 20))
    # A pool of 12 blocks: the second prompt evicts the first prompt's cached blocks.
    llm = LLM(
        tiny_model_dir,
        store=store,
        kv_cache_bytes=12 * TINY_BLOCK_BYTES,
        block_size=16,
        guard=False,
    )
    other = [(i * 11 + 5) % 250 for i in range(150)]
    llm.generate([PROMPT], GREEDY)
    llm.generate([other], GREEDY)
    assert llm.engine.blocks.num_evicted > 0
    out = llm.generate([PROMPT], GREEDY)[0]
    assert out.cached_tokens_by_source.get("cpu", 0) > 0
    assert out.token_ids == reference(tiny_model_dir, [PROMPT])[0]
    store.close()


def test_preemption_and_chunked_prefill_keep_outputs(tiny_model_dir: Path) -> None:
    prompts = [[(i * k + k) % 250 for i in range(60 + 13 * k)] for k in range(1, 7)]
    # 14 blocks for six sequences that need up to 10 each: preemption must happen.
    llm = LLM(tiny_model_dir, kv_cache_bytes=14 * TINY_BLOCK_BYTES, max_num_batched_tokens=40)
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == reference(tiny_model_dir, prompts)


def test_blocks_of_another_model_dtype_or_record_size_are_never_used(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = StoreConfig(cpu_bytes=0, disk_path=str(tmp_path / "disk"), fsync=False)
    with LLM(tiny_model_dir, store=config, kv_cache_bytes=4 << 20, guard=False) as llm:
        llm.generate([PROMPT], GREEDY)
    other_model = make_tiny_llama(tmp_path / "other", seed=1)
    variants = [
        (other_model, {}),
        (tiny_model_dir, {"dtype": "bfloat16"}),
        (tiny_model_dir, {"block_size": 32, "record_tokens": 32}),
        (tiny_model_dir, {"tenant": "someone-else"}),
    ]
    for model, kw in variants:
        with LLM(model, store=config, kv_cache_bytes=4 << 20, **kw, guard=False) as llm:
            out = llm.generate([PROMPT], GREEDY)[0]
        assert out.num_cached_tokens == 0, (model, kw)


# The saver stores records of 16 covering the prompt's first 144 tokens (its later blocks
# hold its own output); the restorer takes whole blocks of its size within them, one token
# short of the new 153-token prompt.
@pytest.mark.parametrize(
    ("saver", "restorer", "cached"), [(16, 32, 128), (32, 16, 144), (32, 64, 128)]
)
def test_engines_of_other_block_sizes_share_records(
    tiny_model_dir: Path, tmp_path: Path, saver: int, restorer: int, cached: int
) -> None:
    config = StoreConfig(cpu_bytes=0, disk_path=str(tmp_path / "disk"), fsync=False)
    with LLM(
        tiny_model_dir, store=config, kv_cache_bytes=4 << 20, block_size=saver, guard=False
    ) as llm:
        llm.generate([PROMPT], GREEDY)
    with LLM(
        tiny_model_dir, store=config, kv_cache_bytes=4 << 20, block_size=restorer, guard=False
    ) as llm:
        out = llm.generate([PROMPT + [1, 2, 3]], GREEDY)[0]
    assert out.cached_tokens_by_source == {"disk": cached}
    assert out.token_ids == reference(tiny_model_dir, [PROMPT + [1, 2, 3]])[0]


def test_a_block_size_that_records_do_not_divide_is_refused_with_tiers(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = StoreConfig(cpu_bytes=0, disk_path=str(tmp_path / "disk"), fsync=False)
    with pytest.raises(ValueError, match="block size 8 is not a multiple of record_tokens 16"):
        LLM(tiny_model_dir, store=config, kv_cache_bytes=4 << 20, block_size=8, guard=False)
    # Without tiers nothing is keyed for sharing, and any block size runs.
    with LLM(tiny_model_dir, kv_cache_bytes=4 << 20, block_size=8) as llm:
        assert llm.generate([PROMPT], GREEDY)[0].token_ids


_CHILD = """
import json, sys
from cachetier.store.config import StoreConfig
from cachetier.engine.llm import LLM
from cachetier.engine.sampling import SamplingParams
model, disk, prompt = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
store = StoreConfig(cpu_bytes=1 << 26, disk_path=disk)
with LLM(model, store=store, kv_cache_bytes=4 << 20, guard=False) as llm:
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0]
print(json.dumps({"tokens": out.token_ids, "by_source": out.cached_tokens_by_source}))
"""


@pytest.mark.slow(reason="runs the tiny-model engine in two fresh processes that each import torch")
def test_a_restarted_process_restores_from_disk(tiny_model_dir: Path, tmp_path: Path) -> None:
    def run() -> dict:
        proc = subprocess.run(
            [
                sys.executable,
                "-c",
                _CHILD,
                str(tiny_model_dir),
                str(tmp_path / "d"),
                json.dumps(PROMPT),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        return json.loads(proc.stdout.strip().splitlines()[-1])

    cold, warm = run(), run()
    assert cold["by_source"] == {}
    assert warm["by_source"] == {"disk": 144}
    assert cold["tokens"] == warm["tokens"] == reference(tiny_model_dir, [PROMPT])[0]


def test_a_prompt_longer_than_the_pool_is_refused(tiny_model_dir: Path) -> None:
    llm = LLM(tiny_model_dir, kv_cache_bytes=4 * TINY_BLOCK_BYTES)
    with pytest.raises(ValueError, match="max_model_len is 64"):
        llm.generate([PROMPT], GREEDY)


def test_a_float_kv_dtype_other_than_the_compute_dtype_is_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="must match dtype"):
        LLM(tiny_model_dir, dtype="float32", kv_cache_dtype="bfloat16")


def test_decodes_behind_a_shared_prefix_match_decodes_alone(tiny_model_dir: Path) -> None:
    # Two groups of sequences decode in one batch: three behind PROMPT's first 8 blocks (read
    # once per step by the shared-prefix attention path) and two behind another prefix.
    other = [(i * 11 + 5) % 250 for i in range(70)]
    prompts = [PROMPT[:128] + [9] * n for n in (1, 20, 37)] + [other + [4] * n for n in (3, 30)]
    llm = LLM(tiny_model_dir, kv_cache_bytes=4 << 20)
    llm.generate([PROMPT[:128], other], GREEDY)  # the prefixes, so the batch hits them
    outs = llm.generate(prompts, GREEDY)
    assert [o.num_cached_tokens for o in outs] == [128, 128, 128, 64, 64]
    assert [o.token_ids for o in outs] == reference(tiny_model_dir, prompts)


@pytest.mark.parametrize("device", ["gpu", "cuda:", "cuda:x", "CPU", "mps", ""])
def test_a_device_that_is_not_cpu_or_cuda_is_refused(tiny_model_dir: Path, device: str) -> None:
    with pytest.raises(ValueError, match="device must be cpu, cuda or cuda:N"):
        LLM(tiny_model_dir, device=device)


def test_a_cuda_device_torch_does_not_have_is_a_clear_error(tiny_model_dir: Path) -> None:
    # On a CPU-only torch: "sees no CUDA device"; on a GPU machine: one past its last GPU.
    with pytest.raises(ValueError, match=r"device 'cuda:\d+': this torch sees|GPU\(s\)"):
        LLM(tiny_model_dir, device=f"cuda:{torch.cuda.device_count()}")


def test_an_explicit_cpu_device_is_the_default_engine(tiny_model_dir: Path) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=5)
    prompt = [[(5 * i) % 250 + 3 for i in range(70)]]
    with LLM(tiny_model_dir, device="cpu", block_size=16) as llm:
        assert llm.engine.device == torch.device("cpu")
        assert llm.engine.pool.cache.device.type == "cpu"
        explicit = llm.generate(prompt, greedy)[0].token_ids
    with LLM(tiny_model_dir, block_size=16) as llm:
        assert explicit == llm.generate(prompt, greedy)[0].token_ids
