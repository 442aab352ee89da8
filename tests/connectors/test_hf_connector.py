"""``HFCacheConnector`` over real tiers: same greedy tokens as plain ``generate``, fewer
prefilled tokens, restores after a restart from disk, never another model's blocks."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from cachetier.connectors.hf import HFCacheConnector
from cachetier.errors import TierUnavailableError
from cachetier.primitives.keys import BlockHash, Namespace, block_keys
from cachetier.record import KVBlock, writer_name
from cachetier.store.config import StoreConfig, build_store
from cachetier.store.tiered import TieredStore
from cachetier.tiers.cpu import CPUTier, CPUTierConfig
from tests.models import ForwardTokens, make_tiny_llama

MiB = 1 << 20
BLOCK_SIZE = 16
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same architecture as ``tiny_model_dir`` with other weights (seed 1)."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-other"), seed=1)


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir: Path) -> torch.nn.Module:
    return _load(tiny_model_dir)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[TieredStore]:
    """CPU in front of a disk tier in this test's own folder (real files)."""
    with build_store(_disk_config(tmp_path / "kv", cpu_bytes=16 * MiB)) as s:
        yield s


def _disk_config(path: Path, *, cpu_bytes: int) -> StoreConfig:
    return StoreConfig(cpu_bytes=cpu_bytes, disk_path=str(path), disk_bytes=256 * MiB, fsync=False)


def _load(folder: Path) -> torch.nn.Module:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, local_files_only=True
    )
    return model.eval()


def _prompt(num_tokens: int, *, seed: int = 1, vocab_size: int = 256) -> torch.Tensor:
    # Ids from 3 up: clear of the tiny model's bos (1) and eos (2).
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (1, num_tokens), generator=generator)


def _greedy(model: torch.nn.Module, prompt: torch.Tensor, new: int = NEW_TOKENS) -> torch.Tensor:
    return model.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, do_sample=False
    )


def test_warm_generate_matches_plain_generate_and_prefills_only_the_tail(
    tiny_model: torch.nn.Module, tiny_model_dir: Path, store: TieredStore
) -> None:
    prompt = _prompt(70)
    with ForwardTokens(tiny_model) as plain_forward:
        expected = _greedy(tiny_model, prompt)
    conn = HFCacheConnector(
        tiny_model, store, model_folder=tiny_model_dir, record_tokens=BLOCK_SIZE
    )

    cold, cold_info = conn.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
    with ForwardTokens(tiny_model) as warm_forward:
        warm, warm_info = conn.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)

    assert torch.equal(cold, expected)
    assert torch.equal(warm, expected)
    assert (cold_info.num_cached_tokens, cold_info.num_computed_prompt_tokens) == (0, 70)
    assert cold_info.num_saved_blocks == 4  # 70 tokens: 4 full blocks of 16
    assert warm_info.num_prompt_tokens == 70
    assert warm_info.num_cached_tokens == 64
    assert warm_info.num_computed_prompt_tokens == 6
    assert warm_info.cached_tokens_by_source == {"cpu": 64}
    assert warm_info.num_saved_blocks == 0  # all four are stored already
    # The model itself saw 64 fewer tokens: the prefill forward got 6 instead of 70.
    assert plain_forward.lengths[0] == 70 and warm_forward.lengths[0] == 6
    assert plain_forward.lengths[1:] == warm_forward.lengths[1:] == [1] * (NEW_TOKENS - 1)
    assert conn.stats.restored_blocks == 4 and conn.stats.rejected_blocks == 0


def test_restore_leaves_at_least_one_prompt_token_and_takes_the_longest_stored_prefix(
    tiny_model: torch.nn.Module, tiny_model_dir: Path, store: TieredStore
) -> None:
    conn = HFCacheConnector(
        tiny_model, store, model_folder=tiny_model_dir, record_tokens=BLOCK_SIZE
    )
    prompt = _prompt(64)
    assert conn.restore(prompt) == (None, 0)
    _, info = conn.generate(prompt, max_new_tokens=2, do_sample=False)
    assert info.num_saved_blocks == 4

    # 64 tokens, all stored: only 3 blocks may be restored, or no prompt token would be left.
    cache, num_cached = conn.restore(prompt)
    assert num_cached == 48 and cache is not None and cache.get_seq_length() == 48
    assert len(cache.layers) == 2
    assert tuple(cache.layers[0].keys.shape) == (1, 2, 48, 16)  # [batch, kv heads, tokens, dim]
    assert conn.restore(prompt[:, :BLOCK_SIZE]) == (None, 0)
    assert conn.restore(prompt[:, : BLOCK_SIZE + 1])[1] == BLOCK_SIZE

    # A prompt that leaves the stored one inside its third block reuses the first two blocks.
    forked = prompt.clone()
    forked[0, 40] = (int(forked[0, 40]) + 1 - 3) % 253 + 3
    forked = torch.cat([forked, _prompt(10, seed=7)], dim=1)
    out, info = conn.generate(forked, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert info.num_cached_tokens == 32 and info.num_computed_prompt_tokens == 74 - 32
    assert torch.equal(out, _greedy(tiny_model, forked))


def test_a_new_connector_over_the_same_disk_folder_restores_after_a_restart(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    prompt = _prompt(90, seed=3)
    first_model = _load(tiny_model_dir)
    expected = _greedy(first_model, prompt)
    with build_store(_disk_config(tmp_path / "kv", cpu_bytes=16 * MiB)) as first_store:
        first = HFCacheConnector(first_model, first_store, model_folder=tiny_model_dir)
        _, info = first.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
        assert info.num_saved_blocks == 5
    assert any(p.is_file() for p in (tmp_path / "kv").rglob("*")), "no block reached the disk"
    del first, first_model

    # A fresh process in all but name: new model object, new store, disk only (no CPU tier).
    second_model = _load(tiny_model_dir)
    with build_store(_disk_config(tmp_path / "kv", cpu_bytes=0)) as second_store:
        second = HFCacheConnector(second_model, second_store, model_folder=tiny_model_dir)
        with ForwardTokens(second_model) as forward:
            out, info = second.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert torch.equal(out, expected)
    assert info.num_cached_tokens == 80
    assert info.cached_tokens_by_source == {"disk": 80}
    assert forward.lengths[0] == 10


def test_blocks_of_another_model_are_never_used(
    tiny_model: torch.nn.Module,
    tiny_model_dir: Path,
    other_model_dir: Path,
    store: TieredStore,
) -> None:
    prompt = _prompt(70, seed=4)
    mine = HFCacheConnector(tiny_model, store, model_folder=tiny_model_dir)
    mine.generate(prompt, max_new_tokens=2, do_sample=False)

    other_model = _load(other_model_dir)
    other = HFCacheConnector(other_model, store, model_folder=other_model_dir)
    assert other.namespace.layout == mine.namespace.layout  # same shapes: only the weights differ
    out, info = other.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert info.num_cached_tokens == 0
    assert torch.equal(out, _greedy(other_model, prompt))

    # Even filed under the other model's keys, blocks that name the first model are refused.
    other_keys = block_keys(other.namespace, prompt[0, :64].tolist())
    store.clear(other.namespace.id)
    mine_blocks = _stored_blocks(store, mine.namespace, prompt[0, :64].tolist())
    forged = [_with(b, key=k) for b, k in zip(mine_blocks, other_keys, strict=True)]
    store.put_many(other.namespace.id, forged)
    assert other.restore(prompt) == (None, 0)


def test_same_weights_under_another_tenant_share_nothing(
    tiny_model: torch.nn.Module, tiny_model_dir: Path, store: TieredStore
) -> None:
    prompt = _prompt(40, seed=5)
    HFCacheConnector(tiny_model, store, model_folder=tiny_model_dir, tenant="a").generate(
        prompt, max_new_tokens=2, do_sample=False
    )
    b = HFCacheConnector(tiny_model, store, model_folder=tiny_model_dir, tenant="b")
    assert b.restore(prompt) == (None, 0)


def test_a_block_of_the_wrong_shape_ends_the_restored_run(
    tiny_model: torch.nn.Module, tiny_model_dir: Path, store: TieredStore
) -> None:
    prompt = _prompt(70, seed=6)
    conn = HFCacheConnector(tiny_model, store, model_folder=tiny_model_dir)
    conn.generate(prompt, max_new_tokens=2, do_sample=False)
    ns = conn.namespace
    good = _stored_blocks(store, ns, prompt[0, :64].tolist())
    # Right key and fingerprint, wrong claims: block 2 says it holds 8 tokens, [L, 2, 8, H, D].
    raw = bytes(good[2].data)
    half = (ns.layout.num_layers, 2, 8, ns.layout.num_kv_heads, ns.layout.head_dim)
    store.clear(ns.id)
    store.put_many(
        ns.id,
        [
            good[0],
            good[1],
            _with(good[2], shape=half, num_tokens=8, data=raw[: len(raw) // 2]),
            good[3],
        ],
    )

    out, info = conn.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert info.num_cached_tokens == 32
    assert conn.stats.rejected_blocks == 1
    assert torch.equal(out, _greedy(tiny_model, prompt))


def test_a_record_that_is_not_its_tokens_kv_ends_the_restored_run(
    tiny_model: torch.nn.Module, tiny_model_dir: Path, store: TieredStore
) -> None:
    prompt = _prompt(70, seed=8)
    conn = HFCacheConnector(tiny_model, store, model_folder=tiny_model_dir)
    conn.generate(prompt, max_new_tokens=2, do_sample=False)
    ns = conn.namespace
    good = _stored_blocks(store, ns, prompt[0, :64].tolist())
    # Block 2 with K and V swapped, by another process: every checksum passes.
    values = np.frombuffer(good[2].data, dtype=np.float32).reshape(good[2].shape)
    swapped = _with(good[2], data=np.ascontiguousarray(values[:, ::-1]).tobytes(), writer=b"x" * 16)
    store.clear(ns.id)
    store.put_many(ns.id, [good[0], good[1], swapped, good[3]])

    out, info = conn.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert info.num_cached_tokens == 32  # blocks 0 and 1; block 2 was refused
    assert conn.record_guard.stats.failed_records == 1
    assert store.quarantines.holds_writer("cpu", ns.id, writer_name(b"x" * 16))
    assert torch.equal(out, _greedy(tiny_model, prompt))


class _OutageTier(CPUTier):
    """A CPU tier whose reads fail while ``down`` is set, as a lost remote tier's would."""

    down = False

    def contains_prefix(self, namespace: str, keys: Sequence[BlockHash]) -> int:
        if self.down:
            raise TierUnavailableError("tier is down")
        return super().contains_prefix(namespace, keys)

    def get_many(self, namespace: str, keys: Sequence[BlockHash]) -> list[KVBlock | None]:
        if self.down:
            raise TierUnavailableError("tier is down")
        return super().get_many(namespace, keys)


def test_a_store_error_is_a_miss(tiny_model: torch.nn.Module, tiny_model_dir: Path) -> None:
    tier = _OutageTier(CPUTierConfig(16 * MiB))
    with TieredStore([tier]) as store:
        conn = HFCacheConnector(tiny_model, store, model_folder=tiny_model_dir)
        prompt = _prompt(50, seed=8)
        conn.generate(prompt, max_new_tokens=2, do_sample=False)
        tier.down = True
        out, info = conn.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
        assert info.num_cached_tokens == 0 and info.num_saved_blocks == 0
        assert conn.stats.store_errors == 2  # the restore and the lookup before the save
        assert torch.equal(out, _greedy(tiny_model, prompt))
        tier.down = False
        assert conn.restore(prompt)[1] == 48


def test_generated_tokens_are_stored_when_asked(
    tiny_model: torch.nn.Module, tiny_model_dir: Path, store: TieredStore
) -> None:
    prompt = _prompt(30, seed=9)
    conn = HFCacheConnector(
        tiny_model, store, model_folder=tiny_model_dir, save_generated_tokens=True
    )
    out, info = conn.generate(prompt, max_new_tokens=20, min_new_tokens=20, do_sample=False)
    # The cache holds 30 + 19 tokens (the last generated one is never fed back): 3 blocks.
    assert info.num_saved_blocks == 3
    follow_up = torch.cat([out, _prompt(5, seed=10)], dim=1)
    out2, info2 = conn.generate(follow_up, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert info2.num_cached_tokens == 48
    assert torch.equal(out2, _greedy(tiny_model, follow_up))


def test_our_engine_and_the_hf_connector_share_blocks(
    tiny_model: torch.nn.Module, tiny_model_dir: Path, store: TieredStore
) -> None:
    from cachetier.engine.llm import LLM
    from cachetier.engine.sampling import SamplingParams

    conn = HFCacheConnector(tiny_model, store, model_folder=tiny_model_dir)
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)

    # Engine first: its finished blocks serve the HF model.
    prompt = _prompt(70, seed=11)
    engine = LLM(
        tiny_model_dir, store=store, kv_cache_bytes=4 * MiB, record_tokens=BLOCK_SIZE, guard=False
    )
    engine_out = engine.generate([prompt[0].tolist()], greedy)[0]
    engine.flush()
    out, info = conn.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert info.num_cached_tokens == 64
    assert torch.equal(out, _greedy(tiny_model, prompt))
    assert out[0, 70:].tolist() == engine_out.token_ids

    # HF first: a fresh engine (empty pool) restores the connector's blocks.
    prompt = _prompt(50, seed=12)
    _, info = conn.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert info.num_saved_blocks == 3
    fresh = LLM(
        tiny_model_dir, store=store, kv_cache_bytes=4 * MiB, record_tokens=BLOCK_SIZE, guard=False
    )
    restored = fresh.generate([prompt[0].tolist()], greedy)[0]
    assert restored.cached_tokens_by_source == {"cpu": 48}
    assert restored.token_ids == _greedy(tiny_model, prompt)[0, 50:].tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_save_then_restore_gives_back_the_same_kv_bits(
    tiny_model_dir: Path, store: TieredStore, dtype: torch.dtype
) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=dtype, local_files_only=True
    )
    conn = HFCacheConnector(model, store, model_folder=tiny_model_dir)
    assert conn.namespace.layout.dtype == str(dtype).removeprefix("torch.")
    prompt = _prompt(40, seed=13)
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(prompt, past_key_values=cache, use_cache=True)
    assert conn.save(prompt, cache) == 2
    assert conn.save(prompt, cache) == 0  # already stored

    restored, num_cached = conn.restore(prompt)
    assert num_cached == 32 and restored is not None
    for ours, theirs in zip(restored.layers, cache.layers, strict=True):
        assert ours.keys.dtype == dtype
        assert torch.equal(ours.keys, theirs.keys[:, :, :32])
        assert torch.equal(ours.values, theirs.values[:, :, :32])


def test_bad_arguments_are_refused(
    tiny_model: torch.nn.Module, tiny_model_dir: Path, store: TieredStore
) -> None:
    with pytest.raises(ValueError, match="exactly one"):
        HFCacheConnector(tiny_model, store)
    conn = HFCacheConnector(tiny_model, store, fingerprint="f" * 64)
    with pytest.raises(ValueError, match="one prompt"):
        conn.generate(_prompt(20).repeat(2, 1), max_new_tokens=2)
    with pytest.raises(ValueError, match="past_key_values"):
        conn.generate(_prompt(20), past_key_values=None, max_new_tokens=2)
    with pytest.raises(ValueError, match="no padding"):
        mask = torch.ones(1, 20, dtype=torch.long)
        mask[0, 0] = 0
        conn.generate(_prompt(20), attention_mask=mask, max_new_tokens=2)
    with pytest.raises(ValueError, match="empty"):
        conn.generate([], max_new_tokens=2)


@pytest.mark.model
@pytest.mark.slow(
    reason="loads SmolLM2 in transformers and generates from a long prompt three times"
)
def test_smollm2_long_prompt_same_tokens_fewer_prefilled(smollm2_dir: Path, tmp_path: Path) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)
    model = _load(smollm2_dir)
    facts = " ".join(
        f"Shelf {i} holds {3 * i + 1} red jars and {i % 5 + 2} blue boxes." for i in range(1, 17)
    )
    text = f"Read the inventory and answer.\n{facts}\nQuestion: how many red jars are on shelf 7?"
    prompt = torch.tensor([tokenizer.encode(text)])
    num_prompt = prompt.shape[1]
    assert 200 <= num_prompt <= 400, num_prompt
    expected = _greedy(model, prompt, new=16)

    with build_store(_disk_config(tmp_path / "kv", cpu_bytes=64 * MiB)) as store:
        conn = HFCacheConnector(model, store, model_folder=smollm2_dir)
        cold, cold_info = conn.generate(prompt, max_new_tokens=16, do_sample=False)
    with build_store(_disk_config(tmp_path / "kv", cpu_bytes=64 * MiB)) as store:
        conn = HFCacheConnector(model, store, model_folder=smollm2_dir)
        with ForwardTokens(model) as forward:
            warm, warm_info = conn.generate(prompt, max_new_tokens=16, do_sample=False)

    assert torch.equal(cold, expected)
    assert torch.equal(warm, expected)
    assert cold_info.num_cached_tokens == 0
    cached = (num_prompt - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert warm_info.num_cached_tokens == cached
    assert warm_info.cached_tokens_by_source == {"disk": cached}
    assert forward.lengths[0] == num_prompt - cached <= BLOCK_SIZE


def _stored_blocks(store: TieredStore, namespace: Namespace, tokens: list[int]) -> list[KVBlock]:
    keys = block_keys(namespace, tokens)
    found = store.restore_prefix(namespace.id, keys, fingerprint=namespace.fingerprint)
    assert len(found.blocks) == len(keys)
    return [_with(b, data=bytes(b.data)) for b in found.blocks]


def _with(block: KVBlock, **changes: object) -> KVBlock:
    return dataclasses.replace(block, **changes)  # checked again by __post_init__
