"""``benchmarks.guard``'s figures of the per-record check and the writers, in our engine.

Each case is a disk folder shared by "processes" that stand for the engines of one node: the
writer id is drawn again between them (``start_new_writer``), as a new process would draw it.
Forged records are written by the benchmark through a disk tier of its own, never through the
engine under test, with valid checksums, and named after the writer the case says.

- **Mixed folder** (``mixed_folder_wrong_answers``): an honest writer stores a first prompt and
  ``n`` others; the others' records are forged under the honest writer's own id (a buggy
  layout conversion in one of its processes). A new engine serves the first prompt (an honest
  first hit, verified in full), then the ``n`` forged ones, one at a time, its pool forgotten
  between them; an answer is wrong where it differs from a cold engine's.
- **After the check** (``after_check_wrong_answers``): the same, but the records are forged
  while the engine serves, after its first hit was verified.
- **Deep layer** (``deep_layer_forgery_wrong_answers_*``): as after the check, with a forgery
  of the last layer only, which the per-record check does not see. Only the guard's draws
  catch it: each request is drawn with ``guard_fraction`` probability, so ``n`` requests give
  ``n * (1 - guard_fraction)`` wrong answers where each forged restore changes the answer
  (``_expected``), against those counted (``_measured``); ``1 / guard_fraction`` requests are
  expected before the first detection.
- **Noise below the tolerance** (``noise_below_tolerance_*``): as after the check, every layer
  moved by a quarter of the per-record check's fp32 tolerance: no check refuses it by design
  (``_refused_records`` counts those it did); ``_wrong_answers`` counts what that tolerance
  lets through. (Noise of half a full verification's tolerance is a first-layer forgery: the
  per-record check's own tolerance is tighter.)
- **Quarantine** (``honest_restores_after_quarantine``): an honest and a buggy writer share the
  folder; the buggy one's records are forged. The engine serves the buggy writer's prompts
  (caught, its writer quarantined), then the honest one's: the share of their stored tokens
  still restored from the tier.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.support.forgeries import (
    Stored,
    noise_below_tolerance,
    noise_in_every_layer,
    values,
    values_of,
)
from benchmarks.support.guard_engine import GREEDY, TINY_POOL, disk_store
from cachetier.engine.llm import LLM
from cachetier.primitives.keys import Namespace
from cachetier.record import KVBlock
from cachetier.record.writer import start_new_writer

FIRST = [(i * 11 + 5) % 250 for i in range(70)]
Forgery = Callable[[list[KVBlock]], list[np.ndarray]]


def prompts(num: int, seed: int) -> list[list[int]]:
    """``num`` distinct prompts of 3 full blocks of 16 and a partial one."""
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, 250, size=60)] for _ in range(num)]


def _changed(change: Callable[[np.ndarray], np.ndarray]) -> Forgery:
    return lambda records: [np.ascontiguousarray(change(values(r).copy())) for r in records]


def _zero(layer: int) -> Callable[[np.ndarray], np.ndarray]:
    def change(v: np.ndarray) -> np.ndarray:
        v[layer] = 0
        return v

    return change


def first_layer_forgeries(model: Path, workdir: Path, targets: list[list[int]]) -> dict:
    """The forgeries that change the first layer, for ``targets``' records: another prompt's
    KV (stored by the model itself), K and V swapped, the first layer zeroed, heads permuted,
    noise in every layer past the per-record check's tolerance."""
    others = [[(t + 1) % 250 for t in p] for p in targets]
    folder = workdir / "other-prompts"
    namespace = _store(model, folder, others)
    with Stored(folder, namespace) as stored:
        other = [r for p in others for r in stored.records(p)]
    return {
        "other_tokens": values_of(other),
        "k_and_v_swapped": _changed(lambda v: v[:, ::-1]),
        "first_layer_zeroed": _changed(_zero(0)),
        "heads_permuted": _changed(lambda v: v[:, :, :, ::-1]),
        "noise_in_every_layer": _changed(noise_in_every_layer),
    }


DEEP_LAYER = _changed(_zero(-1))
NOISE = _changed(noise_below_tolerance)


def _store(model: Path, folder: Path, batch: list[list[int]]) -> Namespace:
    with LLM(model, store=disk_store(folder), guard=False, **TINY_POOL) as llm:
        llm.generate(batch, GREEDY)
        return llm.engine.namespace


def _forge(
    folder: Path, namespace: Namespace, targets: list[list[int]], forge: Forgery, writer: bytes
) -> None:
    with Stored(folder, namespace) as stored:
        records = [r for p in targets for r in stored.records(p)]
        stored.replace(records, forge(records), writer=writer)


def _wrong(llm: LLM, batch: list[list[int]], cold: dict[tuple[int, ...], list[int]]) -> int:
    wrong = 0
    for prompt in batch:
        llm.engine.blocks.clear_cache()  # every hit comes from the disk tier
        wrong += llm.generate([prompt], GREEDY)[0].token_ids != cold[tuple(prompt)]
    return wrong


def served_forged(
    model: Path,
    folder: Path,
    targets: list[list[int]],
    forge: Forgery,
    guard: dict[str, Any],
    cold: dict[tuple[int, ...], list[int]],
    while_serving: bool,
) -> tuple[int, int]:
    """Wrong answers of ``targets`` served after an honest first hit, their records forged
    under the honest writer's id before the engine starts or (``while_serving``) after its
    first hit, and the records the per-record check refused."""
    honest = start_new_writer()
    namespace = _store(model, folder, [FIRST, *targets])
    if not while_serving:
        _forge(folder, namespace, targets, forge, honest)
    start_new_writer()  # the serving engine's own process
    with LLM(model, store=disk_store(folder), **TINY_POOL, **guard) as llm:
        llm.generate([FIRST], GREEDY)
        if while_serving:
            _forge(folder, namespace, targets, forge, honest)
        wrong = _wrong(llm, targets, cold)
        return wrong, llm.engine.bridge.record_guard.stats.failed_records  # type: ignore[union-attr]


def honest_after_quarantine(
    model: Path,
    folder: Path,
    honest: list[list[int]],
    buggy: list[list[int]],
    forge: Forgery,
    guard: dict[str, Any],
) -> dict[str, Any]:
    """The share of the honest writer's stored tokens restored after the buggy one's
    quarantine (see the module docstring)."""
    start_new_writer()
    namespace = _store(model, folder, honest)
    bad = start_new_writer()
    _store(model, folder, buggy)
    _forge(folder, namespace, buggy, forge, bad)
    start_new_writer()
    with LLM(model, store=disk_store(folder), **TINY_POOL, **guard) as llm:
        for prompt in buggy:
            llm.engine.blocks.clear_cache()
            llm.generate([prompt], GREEDY)
        quarantines = llm.engine.stats()["guard"]["quarantined"]
        restored = 0
        for prompt in honest:
            llm.engine.blocks.clear_cache()
            restored += sum(llm.generate([prompt], GREEDY)[0].cached_tokens_by_source.values())
    stored = sum(len(p) // 16 * 16 for p in honest)
    return {
        "honest_restores_after_quarantine": round(restored / stored, 4),
        "quarantined_writers": sorted({q[2] for q in quarantines}),
    }


def record_check_cases(
    model: Path, workdir: Path, guard: dict[str, Any], num: int
) -> dict[str, Any]:
    """Every figure of the module docstring, the guard at ``guard``."""
    targets = prompts(num, seed=7)
    cold_llm = LLM(model, enable_prefix_caching=False, **TINY_POOL)
    cold = {tuple(p): o.token_ids for p, o in zip(targets, cold_llm.generate(targets, GREEDY))}
    forgeries = first_layer_forgeries(model, workdir, targets)
    mixed, after = {}, {}
    for name, forge in forgeries.items():
        mixed[name], _ = served_forged(
            model, workdir / f"mixed-{name}", targets, forge, guard, cold, False
        )
        after[name], _ = served_forged(
            model, workdir / f"after-{name}", targets, forge, guard, cold, True
        )
    deep, _ = served_forged(model, workdir / "deep", targets, DEEP_LAYER, guard, cold, True)
    noisy, refused = served_forged(model, workdir / "noise", targets, NOISE, guard, cold, True)
    half = num // 2
    quarantine = honest_after_quarantine(
        model,
        workdir / "quarantine",
        targets[:half],
        targets[half:],
        forgeries["k_and_v_swapped"],
        guard,
    )
    fraction = guard["guard_fraction"]
    return {
        "record_check_requests": num,
        "mixed_folder_wrong_answers": sum(mixed.values()),
        "mixed_folder_wrong_answers_by_forgery": mixed,
        "after_check_wrong_answers": sum(after.values()),
        "after_check_wrong_answers_by_forgery": after,
        "deep_layer_forgery_wrong_answers_expected": round(num * (1 - fraction), 3),
        "deep_layer_forgery_wrong_answers_measured": deep,
        "noise_below_tolerance_wrong_answers": noisy,
        "noise_below_tolerance_refused_records": refused,
        "deep_layer_forgery_requests_to_detection_expected": round(1 / fraction)
        if fraction
        else None,
        **quarantine,
    }


def record_check_overhead(
    model: Path, workdir: Path, rounds: int, tokens: int, per_record: int | None = None
) -> dict[str, Any]:
    """``record_check_overhead``: the mean TTFT of a warm restore of the restart benchmark's
    prompt (``tokens`` long, from a disk tier) with the per-record check on over its mean with
    the check off, minus 1. The arms take turns restore by restore in one engine (``rounds`` *
    16 pairs, each pair's order alternating), so that a shared machine's drift hits both
    alike; ``_interval`` is the 95% interval of that figure from the pairs' differences, and
    ``_median_pair`` the median of the pairs' ratios. Beside it, ``record_check_share``: the
    check's own seconds (timed inside the engine) over the mean TTFT with it off, a figure the
    machine's noise does not swamp. ``per_record``: tokens checked per record (the engine's
    default if ``None``)."""
    from cachetier.engine.demo import build_prompt
    from cachetier.engine.sampling import SamplingParams

    folder = workdir / "check-overhead"
    engine = {
        "kv_cache_bytes": 3 << 30,
        "max_num_batched_tokens": tokens + 64,
        "kv_load_policy": "always",
    }
    one = SamplingParams(temperature=0, max_tokens=1)
    with LLM(model, store=disk_store(folder), guard=False, **engine) as llm:
        prompt = build_prompt(llm, tokens)
        llm.generate([prompt], one)
    checked = {} if per_record is None else {"record_check_tokens": per_record}
    with LLM(model, store=disk_store(folder), guard=False, **engine, **checked) as llm:
        guard = llm.engine.bridge.record_guard  # type: ignore[union-attr]
        check = guard.check
        times: dict[str, list[float]] = {"on": [], "off": []}

        def restore(arm: str) -> None:
            guard.check = check if arm == "on" else None
            llm.engine.blocks.clear_cache()
            out = llm.generate([prompt], one)[0]
            if not out.cached_tokens_by_source:
                raise AssertionError("the prompt was not restored from the disk tier")
            times[arm].append(out.ttft_s)

        restore("on")  # warm-up
        times["on"].clear()
        before = guard.stats.check_s
        for pair in range(16 * rounds):
            for arm in ("on", "off") if pair % 2 == 0 else ("off", "on"):
                restore(arm)
        check_s = (guard.stats.check_s - before) / len(times["on"])
    on, off = float(np.mean(times["on"])), float(np.mean(times["off"]))
    ratios = [a / b for a, b in zip(times["on"], times["off"])]
    diffs = np.subtract(times["on"], times["off"])
    half = 1.96 * float(np.std(diffs, ddof=1)) / float(np.sqrt(diffs.size)) / off
    mean = on / off - 1
    return {
        "record_check_overhead": round(mean, 4),
        "record_check_overhead_interval": [round(mean - half, 4), round(mean + half, 4)],
        "record_check_overhead_median_pair": round(float(np.median(ratios)) - 1, 4),
        "record_check_pairs": int(diffs.size),
        "record_check_share": round(check_s / off, 4),
        "record_check_s": round(check_s, 5),
        "record_check_ttft_off_s": round(off, 4),
        "record_check_prompt_tokens": len(prompt),
    }
