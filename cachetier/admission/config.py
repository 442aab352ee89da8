"""The admission settings, declared once (``cachetier.util.settings``).

A holder (``StoreConfig``) nests ``AdmissionConfig``: its settings then join the holder's flat
namespace by these names, so ``admission_policy`` is spelt the same in a TOML file, as
``CACHETIER_ADMISSION_POLICY``, as ``--admission-policy`` and in an engine's extra config.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from cachetier.admission.sketch import MAX_COUNT, MAX_TRACKED_KEYS
from cachetier.util.checks import positive_int
from cachetier.util.settings import setting

ADMISSION_POLICIES = ("adaptive", "all", "second_hit", "tinylfu")
"""``adaptive`` admits as whichever of the other three wins on recent traffic, per tier (ghost
simulations on a hashed sample of keys: ``cachetier.admission.adaptive``); ``all`` writes every
block (no filter); ``second_hit`` writes a block the ghost queue saw before; ``tinylfu`` writes a
block the frequency sketch has seen ``admission_threshold`` times (and more often than the tier's
eviction victim, where the tier names one)."""

FIXED_POLICIES = ADMISSION_POLICIES[1:]
"""The policies ``adaptive`` chooses among: each decides by a fixed rule."""

DEFAULT_ADMISSION_POLICY = "adaptive"
"""Why this one: ``cachetier.admission`` (the package docstring)."""

GENERATED_MODES = ("filter", "admit", "refuse")
"""What a filtered tier does with a generated block: judge it like a prompt block, take it
always, or never take it."""

MAX_SAMPLE_KEYS = 1 << 22  # about 0.5 GiB of ghost keys a tier: past that a setting is a typo
_TIER_NAME = re.compile(r"[a-z][a-z0-9_]*")


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """Which blocks each tier below the engine writes.

    Each field's description is declared with it; ``admission_policy`` names the policy
    (``ADMISSION_POLICIES``).
    """

    admission_policy: str = setting(
        DEFAULT_ADMISSION_POLICY,
        "which blocks the tiers past the cheap ones write: ``adaptive`` as whichever of the "
        "other three wins on recent traffic, per tier (ghost simulations of each on a hashed "
        "sample of keys; starts as ``all``); ``all`` every block; ``second_hit`` "
        "a block seen before among the last ``admission_tracked_keys`` distinct keys; "
        "``tinylfu`` a block seen ``admission_threshold`` times lately (a frequency sketch "
        "aged every ``admission_tracked_keys`` sightings). Pinned blocks are always written.",
    )
    admission_tracked_keys: int = setting(
        1_000_000,
        "recent block keys the admission filter remembers: the ghost queue's length "
        "(``second_hit``, about 24 bytes a key) or the frequency sketch's window "
        "(``tinylfu``, about 9 bytes a key).",
    )
    admission_threshold: int = setting(
        2,
        f"``tinylfu``: recent sightings (this one included) a block needs to be written, 1 to "
        f"{MAX_COUNT + 1}.",
    )
    admission_sample_keys: int = setting(
        8_192,
        "``adaptive``: most block keys each tier's ghost tiers hold (the CPU tier's and one per "
        "candidate policy, about 170 bytes a key); keys are sampled at the rate that fits the "
        "tiers' capacities into it, and the candidates' filters shrink by the same rate.",
    )
    admission_cheap_tiers: str = setting(
        "cpu",
        "comma-separated names of the tiers that write every block whatever the policy (the "
        'first tier under the engine: its writes cost a memory copy); ``""`` filters every '
        "tier.",
    )
    admission_generated: str = setting(
        "filter",
        "generated blocks in filtered tiers: ``filter`` judges them as prompt blocks, "
        "``admit`` writes them all (chat, whose next turn resends the answer), ``refuse`` "
        "writes none.",
    )

    def __post_init__(self) -> None:
        if self.admission_policy not in ADMISSION_POLICIES:
            raise ValueError(
                f"admission_policy must be one of {', '.join(ADMISSION_POLICIES)}, got "
                f"{self.admission_policy!r}"
            )
        positive_int("admission_tracked_keys", self.admission_tracked_keys)
        if self.admission_tracked_keys > MAX_TRACKED_KEYS:
            raise ValueError(
                f"admission_tracked_keys must be <= {MAX_TRACKED_KEYS:,}, got "
                f"{self.admission_tracked_keys:,}"
            )
        positive_int("admission_threshold", self.admission_threshold)
        positive_int("admission_sample_keys", self.admission_sample_keys)
        if self.admission_sample_keys > MAX_SAMPLE_KEYS:
            raise ValueError(
                f"admission_sample_keys must be <= {MAX_SAMPLE_KEYS:,}, got "
                f"{self.admission_sample_keys:,}"
            )
        if self.admission_threshold > MAX_COUNT + 1:
            raise ValueError(
                f"admission_threshold must be in [1, {MAX_COUNT + 1}] (the sketch counts to "
                f"{MAX_COUNT + 1}), got {self.admission_threshold}"
            )
        if not isinstance(self.admission_cheap_tiers, str):
            raise ValueError(
                f"admission_cheap_tiers must be comma-separated tier names, got "
                f"{self.admission_cheap_tiers!r}"
            )
        bad = [n for n in _split(self.admission_cheap_tiers) if not _TIER_NAME.fullmatch(n)]
        if bad:
            raise ValueError(
                f"admission_cheap_tiers: {bad} are not tier names (lower case, like 'cpu' or "
                "'disk', separated by commas)"
            )
        if self.admission_generated not in GENERATED_MODES:
            raise ValueError(
                f"admission_generated must be one of {', '.join(GENERATED_MODES)}, got "
                f"{self.admission_generated!r}"
            )

    @property
    def cheap_tiers(self) -> frozenset[str]:
        """The tiers that write every block."""
        return frozenset(_split(self.admission_cheap_tiers))


def _split(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]
