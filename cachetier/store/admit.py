"""The store's use of an admission policy: which of one put's blocks a lower tier writes."""

from __future__ import annotations

from collections.abc import Sequence

from cachetier.admission import AdmissionPolicy
from cachetier.pins.store import StorePins
from cachetier.record import KVBlock


def admitted(
    policy: AdmissionPolicy,
    tier: str,
    namespace: str,
    blocks: Sequence[KVBlock],
    generated: Sequence[bool] | None,
    pins: StorePins,
) -> list[KVBlock]:
    """The blocks of one put that ``tier`` writes (each decision counted by the policy).

    Args:
        policy: the store's policy, the put's sightings already recorded.
        tier: the lower tier's name.
        namespace: storage namespace (its pinned keys are always written).
        blocks: the put's blocks.
        generated: per block, whether it holds generated tokens; ``None``: none does.
        pins: the store's pins.
    """
    if generated is not None and len(generated) != len(blocks):
        raise ValueError(f"{len(generated)} generated flags for {len(blocks)} blocks")
    return [
        block
        for i, block in enumerate(blocks)
        if policy.admit(
            block.key,
            tier=tier,
            nbytes=block.nbytes,
            generated=bool(generated[i]) if generated is not None else False,
            pinned=pins.holds(namespace, block.key),
        )
    ]
