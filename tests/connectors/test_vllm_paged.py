"""The connector's config and its whole-block copies, without starting vLLM (no vLLM import)."""

from __future__ import annotations

import pytest
import torch

from cachetier.connectors.config import (
    VLLM_PLUGIN_KEYS,
    ConnectorConfig,
    open_store,
    plugin_config,
)
from cachetier.connectors.records import check_record
from cachetier.connectors.vllm.launch import kv_transfer_config, serve_flag
from cachetier.connectors.vllm.layouts import CPU_VEC, CUDA_KV, VllmArrangement
from cachetier.connectors.vllm.paged import PagedKV
from cachetier.kernels.staging import payload_view
from cachetier.primitives.keys import KVLayout, Namespace, block_keys, dtype_name
from cachetier.primitives.kv_format import CANONICAL_ARRANGEMENT
from cachetier.record import KVBlock

NUM_LAYERS, NUM_KV_HEADS, BLOCK_SIZE, HEAD_SIZE, NUM_BLOCKS = 3, 2, 32, 8, 10


def _layout(dtype: torch.dtype = torch.float32) -> KVLayout:
    return KVLayout(dtype_name(dtype), BLOCK_SIZE, NUM_LAYERS, NUM_KV_HEADS, HEAD_SIZE)


def _arrangement(kind: str = CPU_VEC, dtype: torch.dtype = torch.float32) -> VllmArrangement:
    return VllmArrangement(kind, _layout(dtype))


def _kv_caches(seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    # vLLM's per-layer page: [num_blocks, num_kv_heads, block_size, 2 * head_size]
    gen = torch.Generator().manual_seed(seed)
    return {
        f"model.layers.{i}.self_attn.attn": torch.randn(
            NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE, generator=gen
        ).to(dtype)
        for i in range(NUM_LAYERS)
    }


def test_vllm_blocks_share_the_canonical_namespace() -> None:
    layout = _arrangement().layout
    assert layout.arrangement == CANONICAL_ARRANGEMENT
    assert layout.payload_shape == (NUM_LAYERS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    engine_layout = KVLayout("float32", BLOCK_SIZE, NUM_LAYERS, NUM_KV_HEADS, HEAD_SIZE)
    assert Namespace("m", layout).fingerprint == Namespace("m", engine_layout).fingerprint


@pytest.mark.parametrize("kind", [CPU_VEC, CUDA_KV])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_then_write_moves_whole_blocks_of_every_layer(kind: str, dtype: torch.dtype) -> None:
    src_caches, dst_caches = _kv_caches(0, dtype), _kv_caches(1, dtype)
    names = list(src_caches)
    src = PagedKV(src_caches, names, _arrangement(kind, dtype))
    dst = PagedKV(dst_caches, names, _arrangement(kind, dtype))
    untouched = {name: kv[[0, 5]].clone() for name, kv in dst_caches.items()}

    payloads = [payload_view(p) for p in src.gather([7, 2, 9])]
    assert all(p.readonly and p.nbytes == _layout(dtype).block_bytes for p in payloads)
    assert dst.write([1, 3, 4], payloads) > 0  # seconds the copy took

    for name in names:
        for s, d in ((7, 1), (2, 3), (9, 4)):
            assert torch.equal(dst_caches[name][d], src_caches[name][s])
        assert torch.equal(dst_caches[name][[0, 5]], untouched[name])


def test_cpu_payload_is_canonical_with_k_transposed_in_the_page() -> None:
    caches = _kv_caches()
    names = list(caches)
    (payload,) = PagedKV(caches, names, _arrangement(CPU_VEC)).gather([6])
    for layer, name in enumerate(names):
        # vLLM-CPU reads a block as [heads, 2 * block_size, head_size], K rows then V rows,
        # and its "vec" kernels keep each head's K as [head_size, block_size].
        rows = caches[name][6].reshape(NUM_KV_HEADS, 2, BLOCK_SIZE * HEAD_SIZE)
        keys = rows[:, 0].reshape(NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE).permute(2, 0, 1)
        values = rows[:, 1].reshape(NUM_KV_HEADS, BLOCK_SIZE, HEAD_SIZE).permute(1, 0, 2)
        assert torch.equal(payload[layer, 0], keys)
        assert torch.equal(payload[layer, 1], values)


def test_cuda_payload_is_canonical_from_k_then_v_cells() -> None:
    caches = _kv_caches()
    names = list(caches)
    (payload,) = PagedKV(caches, names, _arrangement(CUDA_KV)).gather([6])
    for layer, name in enumerate(names):
        # FlashAttention, FlashInfer and Triton: kv.transpose(1, 2).split(head_size, dim=-1).
        cells = caches[name][6]  # [heads, block_size, 2 * head_size]
        assert torch.equal(payload[layer, 0], cells[..., :HEAD_SIZE].transpose(0, 1))
        assert torch.equal(payload[layer, 1], cells[..., HEAD_SIZE:].transpose(0, 1))


def test_paged_kv_rejects_buffers_of_another_layout() -> None:
    caches = _kv_caches()
    other = VllmArrangement(CPU_VEC, KVLayout("float32", 16, NUM_LAYERS, NUM_KV_HEADS, HEAD_SIZE))
    with pytest.raises(ValueError, match="expected"):
        PagedKV(caches, list(caches), other)
    with pytest.raises(ValueError, match="no KV cache"):
        PagedKV(caches, [*caches, "model.layers.9.self_attn.attn"], _arrangement())
    paged = PagedKV(caches, list(caches), _arrangement())
    with pytest.raises(ValueError, match="block ids"):
        paged.gather([NUM_BLOCKS])


def test_check_record_names_what_is_wrong() -> None:
    layout = _layout()
    ns = Namespace("m", layout)
    (key, other_key) = block_keys(ns, list(range(2 * BLOCK_SIZE)))
    payload = bytes(layout.block_bytes)
    good = KVBlock(key, ns.fingerprint, "float32", layout.payload_shape, BLOCK_SIZE, payload)
    assert check_record(good, key, ns.fingerprint, layout) is None
    assert check_record(good, other_key, ns.fingerprint, layout) == "another key"
    assert check_record(good, key, bytes(32), layout) == "another namespace"
    flat = KVBlock(key, ns.fingerprint, "float32", (layout.block_bytes // 4,), BLOCK_SIZE, payload)
    assert "instead of" in check_record(flat, key, ns.fingerprint, layout)
    short = KVBlock(key, ns.fingerprint, "float32", layout.payload_shape, 7, payload)
    assert check_record(short, key, ns.fingerprint, layout) == f"7 tokens instead of {BLOCK_SIZE}"
    # fp8 scales: vLLM has one per layer and cannot apply a block's own.
    shape = layout.payload_shape
    scaled = KVBlock(key, ns.fingerprint, "float32", shape, BLOCK_SIZE, payload, b"s")
    assert "cannot apply" in check_record(scaled, key, ns.fingerprint, layout)
    assert check_record(scaled, key, ns.fingerprint, layout, b"s") is None
    assert "other fp8 scales" in check_record(scaled, key, ns.fingerprint, layout, b"t")


def test_config_from_extra_config() -> None:
    config = ConnectorConfig.from_extra_config(
        {"cpu_bytes": "1048576", "disk_path": "/tmp/x", "tenant": "acme", "fsync": "false"}
    )
    assert (config.store.cpu_bytes, config.store.disk_path, config.tenant, config.store.fsync) == (
        1 << 20,
        "/tmp/x",
        "acme",
        False,
    )
    assert config.has_shared_tier
    assert not ConnectorConfig.from_extra_config({"cpu_bytes": 1 << 20}).has_shared_tier


@pytest.mark.parametrize(
    "extra,match",
    [
        ({"disk_pth": "/tmp/x"}, "unknown kv_connector_extra_config keys"),
        ({"cpu_bytes": 0}, "at least one tier"),
        ({"compression": "zstd"}, "compression"),
        ({"cpu_bytes": "lots"}, "cpu_bytes"),
        ({"redis_url": "http://127.0.0.1:6379"}, "redis"),
        ({"redis_url": "redis://127.0.0.1:6379/0", "redis_key_prefix": "bad prefix"}, "key_prefix"),
        ({"remote_url": "redis://127.0.0.1:8000"}, "http"),
        ({"remote_token": "t" * 20}, "remote_token is set without remote_url"),
    ],
)
def test_config_rejects_bad_values(extra: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ConnectorConfig.from_extra_config(extra)


def test_kv_transfer_config_turns_the_connector_on() -> None:
    got = kv_transfer_config({"disk_path": "/tmp/kv"})
    assert got == {
        "kv_connector": "CacheTierConnector",
        "kv_connector_module_path": "cachetier.connectors.vllm.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"disk_path": "/tmp/kv"},
    }
    assert '"kv_connector":"CacheTierConnector"' in serve_flag({"disk_path": "/tmp/kv"})
    with pytest.raises(ValueError):
        kv_transfer_config({"tiers": "cpu"})


@pytest.mark.parametrize(
    "extra,match",
    [
        (
            {"remote_url": "http://127.0.0.1:8470", "remote_token": "t" * 20},
            "CACHETIER_REMOTE_TOKEN",
        ),
        ({"redis_url": "redis://:hunter2-pass@127.0.0.1:6379/0"}, "CACHETIER_REDIS_URL"),
        ({"disk_path": "/tmp/kv", "fail_on_start_error": False}, "fail_on_start_error"),
    ],
)
def test_secrets_vllm_would_log_are_refused_in_its_config(extra: dict, match: str) -> None:
    """``vllm serve`` logs its --kv-transfer-config unredacted: secrets go in the environment."""
    with pytest.raises(ValueError, match=match) as caught:
        kv_transfer_config(extra)
    assert "t" * 20 not in str(caught.value) and "hunter2" not in str(caught.value)


def test_the_vllm_connector_takes_its_secrets_from_the_environment() -> None:
    extra = {"remote_url": "http://127.0.0.1:8470", "cpu_bytes": 1 << 20}
    env = {"CACHETIER_REMOTE_TOKEN": "s" * 24, "CACHETIER_REDIS_URL": "redis://:pw-1234@h:6379/0"}
    config = plugin_config(extra, env, source="kv_connector_extra_config", keys=VLLM_PLUGIN_KEYS)
    assert config.store.remote_token == "s" * 24
    assert config.store.redis_url == "redis://:pw-1234@h:6379/0"
    assert "s" * 24 not in repr(config) and "pw-1234" not in repr(config)


def test_open_store_stacks_the_configured_tiers(
    tmp_path, redis_url: str, redis_prefix: str
) -> None:
    config = ConnectorConfig.from_extra_config(
        {
            "cpu_bytes": 1 << 20,
            "disk_path": str(tmp_path),
            "redis_url": redis_url,
            "redis_key_prefix": redis_prefix,
        }
    )
    with open_store(config, with_cpu=True) as store:
        assert [tier.name for tier in store.tiers] == ["cpu", "disk", "redis"]
    with open_store(config, with_cpu=False) as store:
        assert [tier.name for tier in store.tiers] == ["disk", "redis"]
    layout = _layout()
    ns = Namespace("m", layout)
    (key,) = block_keys(ns, list(range(BLOCK_SIZE)))
    block = KVBlock(
        key, ns.fingerprint, "float32", layout.payload_shape, BLOCK_SIZE, bytes(layout.block_bytes)
    )
    redis_only = ConnectorConfig.from_extra_config(
        {"cpu_bytes": 0, "redis_url": redis_url, "redis_key_prefix": redis_prefix}
    )
    with open_store(redis_only, with_cpu=True) as store:
        assert [tier.name for tier in store.tiers] == ["redis"]
        store.put_many(ns.id, [block])
        store.flush()
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        assert list(client.scan_iter(match=f"{redis_prefix}:{ns.id}:*")), "not under the prefix"
    finally:
        client.close()
