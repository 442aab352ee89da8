"""The restore guard in our engine, against forgeries that pass every checksum: records written
through a real disk tier, each one a well-formed record of this model's namespace that holds the
wrong KV, written by another process (a writer id of its own). The guard's first verified hit
computes the request as a miss, finds the mismatch, quarantines that writer's records and
deletes the bad ones; the computed blocks take their place, and no answer ever differs from a
cold one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from benchmarks.support.forgeries import (
    Stored,
    another_arrangement,
    k_and_v_swapped,
    values,
    values_of,
)
from cachetier.engine.llm import LLM
from cachetier.engine.sampling import SamplingParams
from cachetier.primitives.keys import Namespace
from cachetier.record import KVBlock, writer_name
from cachetier.report.events import read_events
from cachetier.store.config import StoreConfig
from tests.models import make_tiny_llama

GREEDY = SamplingParams(temperature=0, max_tokens=8)
PROMPT = [(i * 7 + 3) % 250 for i in range(150)]  # 9 full blocks of 16 and a partial one
OTHER_TOKENS = [(i * 13 + 1) % 250 for i in range(150)]
POOL = {"kv_cache_bytes": 4 << 20}
GUARD = {"guard": True, "guard_first_hits": 1, "guard_fraction": 0.0}
FORGER = b"forger-process.."  # the writer id the forged records name

Forgery = Callable[[list[KVBlock], "Stored"], list[np.ndarray]]


def _k_and_v_swapped(records: list[KVBlock], _: Stored) -> list[np.ndarray]:
    return k_and_v_swapped(records)


def _another_arrangement(records: list[KVBlock], _: Stored) -> list[np.ndarray]:
    return another_arrangement(records)


def _other_tokens(records: list[KVBlock], stored: Stored) -> list[np.ndarray]:
    return values_of(stored.records(OTHER_TOKENS))(records)


@pytest.fixture
def folder(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "disk"


def _config(folder: Path) -> StoreConfig:
    return StoreConfig(cpu_bytes=0, disk_path=str(folder), fsync=False)


def _cold(model: Path, tokens: list[int]) -> list[int]:
    llm = LLM(model, enable_prefix_caching=False, **POOL)
    return llm.generate([tokens], GREEDY)[0].token_ids


def _store_prompts(model: Path, folder: Path, prompts: list[list[int]]) -> Namespace:
    with LLM(model, store=_config(folder), **POOL) as llm:
        llm.generate(prompts, GREEDY)
        return llm.engine.namespace


def _guarded_run(model: Path, folder: Path, tokens: list[int]) -> tuple[list, dict]:
    """Two requests for ``tokens`` in a guarded engine, the pool forgotten between them: the
    first is verified, the second is served by what the tiers may still serve."""
    with LLM(model, store=_config(folder), **POOL, **GUARD) as llm:
        first = llm.generate([tokens], GREEDY)[0]
        llm.engine.blocks.clear_cache()
        second = llm.generate([tokens], GREEDY)[0]
        return [first, second], llm.engine.stats()


@pytest.mark.parametrize(
    "forge", [_k_and_v_swapped, _another_arrangement, _other_tokens], ids=lambda f: f.__name__
)
def test_a_forgery_of_this_models_kv_is_caught_and_never_served(
    tiny_model_dir: Path, folder: Path, forge: Forgery
) -> None:
    namespace = _store_prompts(tiny_model_dir, folder, [PROMPT, OTHER_TOKENS])
    stored = Stored(folder, namespace)
    records = stored.records(PROMPT)
    stored.replace(records, forge(records, stored), writer=FORGER)
    tokens = PROMPT + [1, 2, 3]
    outs, stats = _guarded_run(tiny_model_dir, folder, tokens)
    cold = _cold(tiny_model_dir, tokens)
    assert [o.token_ids for o in outs] == [cold, cold]
    # The second is served from the disk: the first request's own computed records.
    assert [o.cached_tokens_by_source for o in outs] == [{}, {"disk": 144}]
    assert stats["guard"]["quarantined"] == [("disk", namespace.id, writer_name(FORGER))]
    assert stats["guard"]["verified_requests"] == 1
    assert stats["guard"]["mismatched_blocks"] == len(records)


def test_another_models_kv_under_this_models_fingerprint_is_caught(
    tiny_model_dir: Path, folder: Path, tmp_path: Path
) -> None:
    ours = _store_prompts(tiny_model_dir, folder, [PROMPT])
    other_model = make_tiny_llama(tmp_path / "other", seed=1)
    theirs = _store_prompts(other_model, folder, [PROMPT])
    stored = Stored(folder, ours)
    # The other model's KV for the same tokens, re-keyed into this model's namespace: what a
    # fingerprint set by hand to the same value for two models would store.
    stored.replace(
        stored.records(PROMPT),
        [values(r) for r in Stored(folder, theirs).records(PROMPT)],
        writer=FORGER,
    )
    outs, stats = _guarded_run(tiny_model_dir, folder, PROMPT)
    assert [o.token_ids for o in outs] == [_cold(tiny_model_dir, PROMPT)] * 2
    assert stats["guard"]["quarantined"] == [("disk", ours.id, writer_name(FORGER))]


def test_honest_records_pass_and_are_served_after_the_check(
    tiny_model_dir: Path, folder: Path
) -> None:
    namespace = _store_prompts(tiny_model_dir, folder, [PROMPT])
    outs, stats = _guarded_run(tiny_model_dir, folder, PROMPT + [1, 2, 3])
    cold = _cold(tiny_model_dir, PROMPT + [1, 2, 3])
    assert [o.token_ids for o in outs] == [cold, cold]
    # The first request was verified (computed), the second restored from the disk.
    assert outs[0].cached_tokens_by_source == {}
    assert outs[1].cached_tokens_by_source == {"disk": 144}
    guard = stats["guard"]
    assert guard["quarantined"] == [] and guard["mismatched_blocks"] == 0
    assert guard["verified_blocks"] == 9
    assert Stored(folder, namespace).records(PROMPT)  # nothing was deleted


def test_a_guard_turned_off_restores_every_hit(tiny_model_dir: Path, folder: Path) -> None:
    _store_prompts(tiny_model_dir, folder, [PROMPT])
    with LLM(tiny_model_dir, store=_config(folder), guard=False, **POOL) as llm:
        out = llm.generate([PROMPT + [1]], GREEDY)[0]
        assert out.cached_tokens_by_source == {"disk": 144}
        assert "guard" not in llm.engine.stats()


def test_the_guard_is_on_by_default(tiny_model_dir: Path, folder: Path) -> None:
    """Out of the box the first hit after a start is verified, later ones restored."""
    _store_prompts(tiny_model_dir, folder, [PROMPT])
    with LLM(tiny_model_dir, store=_config(folder), **POOL) as llm:
        first = llm.generate([PROMPT + [1]], GREEDY)[0]
        llm.engine.blocks.clear_cache()
        second = llm.generate([PROMPT + [2]], GREEDY)[0]
        assert first.cached_tokens_by_source == {}
        assert second.cached_tokens_by_source == {"disk": 144}
        assert llm.engine.stats()["guard"]["verified_blocks"] == 9


def test_the_event_log_says_what_was_verified_and_what_a_quarantine_cost(
    tiny_model_dir: Path, folder: Path, tmp_path: Path
) -> None:
    namespace = _store_prompts(tiny_model_dir, folder, [PROMPT, OTHER_TOKENS])
    stored = Stored(folder, namespace)
    for tokens in (PROMPT, OTHER_TOKENS):  # the forger's work, both prompts
        records = stored.records(tokens)
        stored.replace(records, _k_and_v_swapped(records, stored), writer=FORGER)
    log = tmp_path / "lookups.jsonl"
    with LLM(tiny_model_dir, store=_config(folder), event_log=str(log), **POOL, **GUARD) as llm:
        llm.generate([PROMPT + [1]], GREEDY)  # verified: the forgery is caught
        llm.generate([OTHER_TOKENS + [1]], GREEDY)  # the forger's records: refused as read
        llm.engine.close()
    verified, lost = read_events(log, strict=True)
    assert verified.verified_tokens == 144 and dict(verified.hit_tokens) == {}
    assert dict(lost.miss_tokens) == {"quarantined": 144, "partial_block": 7}
    assert dict(lost.hit_tokens) == {}
