"""The restore guard in vLLM (``cachetier.guard``): a sampled hit is reported to vLLM as no hit,
so vLLM computes it, and the worker compares the blocks vLLM computed with the tier's records
of the same keys as it saves them.

The scheduler side draws the hits (``draw``) and sends, with each save, the tier that held each
key (``BlockTransfer.verify_tiers``); the worker compares before it stores (``verify_saved``)
and reports the quarantines it began, which the scheduler side adds to its own list so that its
lookups pass over the tier too (scheduler and worker may be separate processes).
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm.logger import init_logger

from cachetier.connectors.vllm.metadata import BlockTransfer
from cachetier.errors import CacheTierError
from cachetier.guard import GuardSampler
from cachetier.primitives.keys import BlockHash
from cachetier.record import KVBlock
from cachetier.store.tiered import TieredStore

logger = init_logger("vllm.cachetier.guard")


def draw(
    guard: GuardSampler | None,
    namespace_id: str,
    spans: Sequence[tuple[str, int]],
    keys: Sequence[BlockHash],
) -> dict[BlockHash, str] | None:
    """Whether to verify a hit: if so, the tier of each of its keys.

    Args:
        guard: the sampler (``None``: the guard is off).
        namespace_id: the request's storage namespace.
        spans: ``(tier, records)`` runs of the hit, in order from ``keys[0]``.
        keys: the record keys looked up.

    Returns:
        ``{key: tier}`` of every hit record when the hit is drawn, else ``None``.
    """
    if guard is None or not spans:
        return None
    if not guard.should_verify_hit((tier for tier, _ in spans), namespace_id):
        return None
    tiers: dict[BlockHash, str] = {}
    pos = 0
    for tier, count in spans:
        for key in keys[pos : pos + count]:
            tiers[key] = tier
        pos += count
    return tiers


def verify_saved(
    store: TieredStore,
    transfer: BlockTransfer,
    records: Sequence[KVBlock],
    writer: str = "",
    pending: dict[BlockHash, str] | None = None,
    sampler: GuardSampler | None = None,
) -> list[tuple[str, str, str, str]]:
    """Compare the records of a save that a verified hit waits for with their tiers.

    Args:
        store: the worker's tiers.
        transfer: the save, with ``verify_tiers`` (the scheduler's draws).
        records: the records vLLM computed for ``transfer.keys``.
        writer: what the records claim to be (their layout), for the guard's log line.
        pending: the worker's own waits (``{key: tier}``: records a load did not use because
            their writer is verified first, ``record_guard``); those found are taken out.
        sampler: credits the writers a scheduler's draw found clean
            (``GuardSampler.credit_writer``).

    Returns:
        ``(tier, namespace id, reason, writer)`` of each writer quarantine this began.
    """
    by_tier: dict[tuple[str, bool], list[KVBlock]] = {}
    drawn = transfer.verify_tiers or ("",) * len(records)
    for record, tier in zip(records, drawn, strict=True):
        own = pending.pop(record.key, "") if pending else ""
        if tier or own:
            by_tier.setdefault((tier or own, bool(tier)), []).append(record)
    began = []
    for (tier, by_draw), computed in by_tier.items():
        try:
            verdict = store.verify(transfer.namespace_id, tier, computed, writer)
        except (CacheTierError, OSError, ValueError) as exc:
            logger.warning("cachetier guard: could not verify tier %s: %s", tier, exc)
            continue
        for name in verdict.clean_writers if by_draw and sampler is not None else ():
            sampler.credit_writer(tier, transfer.namespace_id, name)
        if verdict.quarantined:
            reason = verdict.mismatches[0].describe()
            began += [
                (t, transfer.namespace_id, reason, w)
                for w in verdict.bad_writers
                for t in store.tier_names
            ]
    return began
