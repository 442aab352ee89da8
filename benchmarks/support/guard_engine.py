"""``benchmarks.guard``'s parts that run our engine in the benchmark's process: the four
forgeries, an honest restart verifying every hit, and the guard's overhead.

- **Forgeries** (a tiny random Llama in fp32, a disk tier): a prompt and another are stored;
  the prompt's records are rewritten with each forgery of ``benchmarks.support.forgeries``
  (K and V swapped, another arrangement labelled canonical, another prompt's KV, another
  model's KV of the same prompt under this model's fingerprint), each passing every checksum.
  A fresh engine with the guard at the given settings serves the prompt twice, its pool
  forgotten in between.
- **Honest restart**: an engine stores the requests; a restarted one verifies every hit
  (``guard_fraction`` 1) and serves each request with its pool forgotten in between.
- **Overhead**: over a filled disk tier (its only tier, so every hit is a restore from it), a
  restarted engine built with the guard at the given settings serves the same batch in rounds,
  the guard switched between its arms (``benchmarks.support.guard_rounds``) and the pool
  forgotten before each batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.support.forgeries import Stored, another_arrangement, k_and_v_swapped, values_of
from benchmarks.support.guard_rounds import alternate, overheads
from cachetier.engine.llm import LLM
from cachetier.engine.sampling import SamplingParams
from cachetier.engine.shadow import ShadowVerifier
from cachetier.guard import GuardSampler
from cachetier.primitives.keys import Namespace
from cachetier.store.config import StoreConfig
from tests.models import make_tiny_llama

GREEDY = SamplingParams(temperature=0, max_tokens=8)
PROMPT = [(i * 7 + 3) % 250 for i in range(150)]  # 9 full blocks of 16 and a partial one
OTHER = [(i * 13 + 1) % 250 for i in range(150)]
# Every hit loaded, whatever the cost model would pick on a busy machine: these cases check
# what a restore serves, not whether it pays (a load refused as too slow is no test at all).
TINY_POOL = {"kv_cache_bytes": 4 << 20, "kv_load_policy": "always"}
FORGER = b"forger-process.."  # the forged records name a writer of their own: another process
EVERY_HIT = {"guard": True, "guard_first_hits": 0, "guard_fraction": 1.0}


def disk_store(folder: Path) -> StoreConfig:
    """A store whose only tier is a disk folder: every hit is a restore from it."""
    return StoreConfig(cpu_bytes=0, disk_path=str(folder), fsync=False)


def _store(model: Path, folder: Path, prompts: list[list[int]], **engine: Any) -> Namespace:
    with LLM(model, store=disk_store(folder), guard=False, **engine) as llm:
        llm.generate(prompts, GREEDY)
        return llm.engine.namespace


def _forgery_case(
    name: str,
    model: Path,
    folder: Path,
    forge: Callable[[list], list],
    cold: list[int],
    guard: dict[str, Any],
) -> dict[str, Any]:
    """Serve the forged prompt twice in a fresh guarded engine; what the guard did."""
    namespace = _store(model, folder, [PROMPT, OTHER], **TINY_POOL)
    with Stored(folder, namespace) as stored:
        records = stored.records(PROMPT)
        stored.replace(records, forge(records), writer=FORGER)
    with LLM(model, store=disk_store(folder), **TINY_POOL, **guard) as llm:
        first = llm.generate([PROMPT], GREEDY)[0]
        caught_after = llm.engine.stats()["guard"]["verified_requests"]
        llm.engine.blocks.clear_cache()
        second = llm.generate([PROMPT], GREEDY)[0]
        stats = llm.engine.stats()["guard"]
    quarantined = any(q[:2] == ("disk", namespace.id) for q in stats["quarantined"])
    return {
        "engine": "ours",
        "forgery": name,
        "detected": quarantined and caught_after <= guard["guard_first_hits"],
        "verified_requests_to_detect": caught_after,
        "outputs_differing_from_cold": sum(o.token_ids != cold for o in (first, second)),
        "served_from_tiers": sum(bool(o.cached_tokens_by_source) for o in (first, second)),
    }


def engine_forgeries(workdir: Path, guard: dict[str, Any]) -> list[dict[str, Any]]:
    """The four forgeries through our engine, the guard at ``guard`` (its settings by name).

    Returns:
        One row per forgery: ``detected`` (quarantined within ``guard_first_hits`` verified
        requests), ``outputs_differing_from_cold`` (of its two requests),
        ``served_from_tiers`` (requests that restored anything).
    """
    model = make_tiny_llama(workdir / "tiny", seed=0)
    other_model = make_tiny_llama(workdir / "tiny-other", seed=1)
    cold = LLM(model, enable_prefix_caching=False, **TINY_POOL).generate([PROMPT], GREEDY)[0]
    theirs_folder, mine_folder = workdir / "other-model", workdir / "other-prompt"
    with (
        Stored(theirs_folder, _store(other_model, theirs_folder, [PROMPT], **TINY_POOL)) as theirs,
        Stored(mine_folder, _store(model, mine_folder, [OTHER], **TINY_POOL)) as mine,
    ):
        forgeries = {
            "k_and_v_swapped": k_and_v_swapped,
            "another_arrangement": another_arrangement,
            "other_tokens": values_of(mine.records(OTHER)),
            "another_model": values_of(theirs.records(PROMPT)),
        }
    return [
        _forgery_case(name, model, workdir / f"case-{name}", forge, cold.token_ids, guard)
        for name, forge in forgeries.items()
    ]


def honest_restart(
    model: Path, workdir: Path, dtype: str, requests: list[list[int]]
) -> dict[str, Any]:
    """Store ``requests``, restart, verify every hit; what the guard found.

    Returns:
        ``false_quarantines`` (quarantines begun), ``verified_requests``,
        ``verified_blocks`` and ``mismatched_blocks``.
    """
    folder = workdir / f"honest-{dtype}"
    engine = {"dtype": dtype, "kv_cache_bytes": 1 << 30, "max_num_batched_tokens": 2048}
    _store(model, folder, requests, **engine)
    with LLM(model, store=disk_store(folder), **engine, **EVERY_HIT) as llm:
        for prompt in requests:
            llm.generate([prompt], GREEDY)
            llm.engine.blocks.clear_cache()
        stats = llm.engine.stats()["guard"]
    return {
        "engine": "ours",
        "dtype": dtype,
        "false_quarantines": len(stats["quarantined"]),
        "verified_requests": stats["verified_requests"],
        "verified_blocks": stats["verified_blocks"],
        "mismatched_blocks": stats["mismatched_blocks"],
    }


def _switch(llm: LLM) -> Callable[[str], None]:
    """Puts ``llm`` in one of ``guard_rounds.ARMS`` by swapping the verifier its bridge holds
    (``None`` is what ``guard=False`` builds)."""
    bridge = llm.engine.bridge
    built = bridge.shadow
    if built is None:
        raise ValueError("build the engine with the guard on: its arms are made from it")

    def switch(arm: str) -> None:
        if arm == "first":
            fresh = GuardSampler(built.sampler.config)
            bridge.shadow = ShadowVerifier(built.store, built.namespace_id, fresh, built.writer)
        else:
            bridge.shadow = built if arm == "on" else None

    return switch


def engine_overhead(
    model: Path,
    workdir: Path,
    requests: list[list[int]],
    rounds: int,
    guard: dict[str, Any],
    max_tokens: int,
) -> dict[str, Any]:
    """The guard's overhead in our engine (``guard_rounds.overheads``' figures, ``engine``).

    Args:
        model: the model folder.
        workdir: where the disk tier goes.
        requests: the batch (prompts).
        rounds: batches per arm.
        guard: the guard's settings by name (the ``on`` arm's).
        max_tokens: greedy tokens out per request, EOS ignored.
    """
    folder = workdir / "overhead"
    engine = {"kv_cache_bytes": 1 << 30, "max_num_batched_tokens": 2048, "max_num_seqs": 64}
    _store(model, folder, requests, **engine)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    restored: list[int] = []

    with LLM(model, store=disk_store(folder), **engine, **guard) as llm:

        def batch() -> float:
            llm.engine.blocks.clear_cache()  # every hit comes from the disk tier
            start = time.perf_counter()
            outs = llm.generate(requests, params)
            seconds = time.perf_counter() - start
            restored.append(sum(sum(o.cached_tokens_by_source.values()) for o in outs))
            return seconds

        batch()  # warm-up: the sampler's first verified hit
        out = overheads(alternate(_switch(llm), batch, rounds), "engine")
    out["engine_restored_tokens_per_batch"] = max(restored)
    return out
