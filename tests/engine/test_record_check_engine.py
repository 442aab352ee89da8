"""Every restored record checked against its own tokens, in our engine, against forgeries
written through a real disk tier by "other processes" (writer ids drawn again, as a new process
draws its own): a buggy writer's records among honest ones, records that go bad after the
first check, a new writer's first records, and what only sampling can catch."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from benchmarks.support.forgeries import Stored, noise_below_tolerance, noise_in_every_layer, values
from cachetier.engine.llm import LLM
from cachetier.engine.sampling import SamplingParams
from cachetier.primitives.keys import Namespace
from cachetier.record import KVBlock, writer_name
from cachetier.record.writer import start_new_writer
from cachetier.store.config import StoreConfig

GREEDY = SamplingParams(temperature=0, max_tokens=8)
FIRST = [(i * 11 + 5) % 250 for i in range(70)]  # the honest first hit
PROMPT = [(i * 7 + 3) % 250 for i in range(150)]  # 9 full blocks of 16 and a partial one
OTHER = [(i * 13 + 1) % 250 for i in range(150)]
POOL = {"kv_cache_bytes": 4 << 20}
# Every hit loaded: what is restored here is the guard's to decide, not the cost model's (on a
# busy machine its measured disk rate may send a hit's head to be recomputed).
DEFAULTS = {
    "guard": True,
    "guard_first_hits": 1,
    "guard_fraction": 0.0,
    "kv_load_policy": "always",
}

Change = Callable[[np.ndarray], np.ndarray]


def _zero(layer: int) -> Change:
    def change(v: np.ndarray) -> np.ndarray:
        v = v.copy()
        v[layer] = 0
        return v

    return change


FIRST_LAYER: dict[str, Change] = {
    "k_and_v_swapped": lambda v: v[:, ::-1],
    "heads_permuted": lambda v: v[:, :, :, ::-1],
    "first_layer_zeroed": _zero(0),
    # Half a full verification's tolerance in every layer: within it, but not within the
    # per-record check's first-layer tolerance.
    "noise_in_every_layer": noise_in_every_layer,
}


def _config(folder: Path) -> StoreConfig:
    return StoreConfig(cpu_bytes=0, disk_path=str(folder), fsync=False)


def _store(model: Path, folder: Path, prompts: list[list[int]]) -> Namespace:
    with LLM(model, store=_config(folder), guard=False, **POOL) as llm:
        llm.generate(prompts, GREEDY)
        return llm.engine.namespace


def _forge(
    folder: Path, namespace: Namespace, tokens: list[int], payloads: Callable, writer: bytes
) -> list[KVBlock]:
    with Stored(folder, namespace) as stored:
        records = stored.records(tokens)
        stored.replace(records, payloads(records), writer=writer)
    return records


def _cold(model: Path, tokens: list[int]) -> list[int]:
    return LLM(model, enable_prefix_caching=False, **POOL).generate([tokens], GREEDY)[0].token_ids


def _changed(change: Change) -> Callable[[list[KVBlock]], list[np.ndarray]]:
    return lambda records: [np.ascontiguousarray(change(values(r))) for r in records]


@pytest.mark.parametrize("name", [*FIRST_LAYER, "other_tokens"])
def test_a_trusted_writers_forged_records_are_never_served(
    tiny_model_dir: Path, tmp_path: Path, name: str
) -> None:
    folder = tmp_path / "disk"
    honest = start_new_writer()
    namespace = _store(tiny_model_dir, folder, [FIRST, PROMPT, OTHER])
    if name == "other_tokens":
        with Stored(folder, namespace) as stored:
            other = stored.records(OTHER)
        forged: Callable = lambda records: [values(r) for r in other[: len(records)]]  # noqa: E731
    else:
        forged = _changed(FIRST_LAYER[name])
    start_new_writer()  # the serving engine's own process
    with LLM(tiny_model_dir, store=_config(folder), **POOL, **DEFAULTS) as llm:
        first = llm.generate([FIRST], GREEDY)[0]  # verified in full: the honest writer trusted
        # The same writer's records of PROMPT go bad while the engine serves.
        _forge(folder, namespace, PROMPT, forged, honest)
        llm.engine.blocks.clear_cache()
        out = llm.generate([PROMPT + [1]], GREEDY)[0]
        stats = llm.engine.stats()
    assert first.cached_tokens_by_source == {}  # the namespace's first hit, computed
    assert out.token_ids == _cold(tiny_model_dir, PROMPT + [1])
    assert out.cached_tokens_by_source == {}  # refused at its first record
    assert ("disk", namespace.id, writer_name(honest)) in stats["guard"]["quarantined"]
    assert stats["record_guard"]["failed_records"] == 1


def test_another_writers_quarantine_leaves_honest_writers_serving(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "disk"
    start_new_writer()
    namespace = _store(tiny_model_dir, folder, [FIRST, PROMPT])
    buggy = start_new_writer()
    _store(tiny_model_dir, folder, [OTHER])
    _forge(folder, namespace, OTHER, _changed(FIRST_LAYER["k_and_v_swapped"]), buggy)
    start_new_writer()
    with LLM(tiny_model_dir, store=_config(folder), **POOL, **DEFAULTS) as llm:
        llm.generate([FIRST], GREEDY)
        llm.engine.blocks.clear_cache()
        bad = llm.generate([OTHER + [1]], GREEDY)[0]
        llm.engine.blocks.clear_cache()
        good = llm.generate([PROMPT + [1]], GREEDY)[0]
        quarantined = llm.engine.stats()["guard"]["quarantined"]
    assert bad.token_ids == _cold(tiny_model_dir, OTHER + [1])
    assert [q[2] for q in quarantined] == [writer_name(buggy)]
    assert good.cached_tokens_by_source == {"disk": 144}  # the honest writer's, restored


def test_a_new_writers_first_restore_is_computed_then_trusted(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "disk"
    start_new_writer()
    _store(tiny_model_dir, folder, [FIRST])
    start_new_writer()  # a second process writes to the same folder later
    _store(tiny_model_dir, folder, [PROMPT])
    start_new_writer()
    with LLM(tiny_model_dir, store=_config(folder), **POOL, **DEFAULTS) as llm:
        llm.generate([FIRST], GREEDY)  # the namespace's first hit (and its writer's)
        outs = []
        for _ in range(2):
            llm.engine.blocks.clear_cache()
            outs.append(llm.generate([PROMPT + [1]], GREEDY)[0])
        stats = llm.engine.stats()
    # The second writer's first records were computed and compared, then restored.
    assert [o.cached_tokens_by_source for o in outs] == [{}, {"disk": 144}]
    assert outs[0].token_ids == outs[1].token_ids
    assert stats["record_guard"]["new_writer_verifications"] == 1
    assert stats["guard"]["mismatched_blocks"] == 0 and stats["guard"]["quarantined"] == []


def test_a_deeper_layer_forgery_of_a_trusted_writer_is_caught_only_when_drawn(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    # The documented limit of the per-record check: only the guard's draws see deeper layers.
    folder = tmp_path / "disk"
    honest = start_new_writer()
    namespace = _store(tiny_model_dir, folder, [FIRST, PROMPT])
    _forge(folder, namespace, PROMPT, _changed(_zero(-1)), honest)
    start_new_writer()
    every = {**DEFAULTS, "guard_fraction": 1.0}
    with LLM(tiny_model_dir, store=_config(folder), **POOL, **every) as llm:
        llm.generate([FIRST], GREEDY)
        llm.engine.blocks.clear_cache()
        out = llm.generate([PROMPT + [1]], GREEDY)[0]
        quarantined = llm.engine.stats()["guard"]["quarantined"]
    assert out.token_ids == _cold(tiny_model_dir, PROMPT + [1])
    assert [q[2] for q in quarantined] == [writer_name(honest)]


def test_noise_below_the_tolerance_is_served_as_honest(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    # A quarter of the per-record check's fp32 tolerance in every layer: no check can tell it
    # from an honest record's rounding, so it is served, and neither the record check nor a
    # full verification of the writer's first hit quarantines it (``benchmarks.guard`` counts
    # what it does to answers).
    folder = tmp_path / "disk"
    writer = start_new_writer()
    namespace = _store(tiny_model_dir, folder, [FIRST, PROMPT])
    _forge(folder, namespace, FIRST, _changed(noise_below_tolerance), writer)
    _forge(folder, namespace, PROMPT, _changed(noise_below_tolerance), writer)
    start_new_writer()
    with LLM(tiny_model_dir, store=_config(folder), **POOL, **DEFAULTS) as llm:
        llm.generate([FIRST], GREEDY)  # the writer's first hit: verified in full
        llm.engine.blocks.clear_cache()
        out = llm.generate([PROMPT], GREEDY)[0]
        stats = llm.engine.stats()
    assert out.cached_tokens_by_source == {"disk": 144}
    assert stats["record_guard"]["failed_records"] == 0
    assert stats["guard"]["mismatched_blocks"] == 0 and stats["guard"]["quarantined"] == []
    assert stats["guard"]["verified_blocks"] > 0
