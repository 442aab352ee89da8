"""The adaptive admission policy: per filtered tier, admit as the fixed policy that wins now.

No fixed policy is best at every disk size (``docs/architecture.md``, "Why adaptive admission
is the default"): a filter keeps one-hit blocks from pushing reused ones out of a small disk,
and loses the second use of every block a large disk would have kept. So ``Adaptive`` runs all
three fixed policies at full size (their filters see every sighting, as they would alone) and,
per filtered tier of known capacity, a ``TierSimulation`` that measures what each would hit
there on a hashed sample of keys; the tier admits as the simulation's current choice.

A tier's simulation is built at its first ``admit`` (the block's bytes turn the tier's
capacity in bytes into blocks). A tier whose capacity is not known (a Redis without
``redis_bytes``, a sidecar) is written as store-all. Every tier starts as store-all, or as the
choice kept in the state file (``cachetier.admission.state_file``) for the same capacities.

Memory, fixed at construction: the full-size filters of ``second_hit`` and ``tinylfu`` (about
33 bytes per ``admission_tracked_keys``) and, per simulated tier, at most three times
``admission_sample_keys`` ghost keys (about 170 bytes each) and the sampled filters
(``TierSimulation.nbytes``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from cachetier.admission.config import FIXED_POLICIES, AdmissionConfig
from cachetier.admission.policy import FIXED_POLICY_CLASSES, AdmissionPolicy
from cachetier.admission.simulation import START_CHOICE, TierSimulation
from cachetier.admission.state_file import AdmissionStateFile

SAVE_EVERY_WINDOWS = 64
"""The state file is rewritten at every switch and at least every this many scoring windows."""


class Adaptive(AdmissionPolicy):
    """Admits, per filtered tier, as the fixed policy its ghost simulation finds best lately.

    Args:
        config: the admission settings.
        tier_bytes: capacity in bytes of each tier by name (the cheap ones too: their sum is
            the cache above each filtered tier); a tier left out is written as store-all.
        state_file: where the choices are kept across restarts; ``None``: not kept.
        block_bytes: bytes of a block, to count capacities in blocks; ``None``: the bytes of
            the first block each tier is asked about.
    """

    name = "adaptive"

    def __init__(
        self,
        config: AdmissionConfig,
        *,
        tier_bytes: Mapping[str, int] | None = None,
        state_file: AdmissionStateFile | None = None,
        block_bytes: int | None = None,
    ) -> None:
        super().__init__(config)
        self._block_bytes = block_bytes
        self._fixed = {n: FIXED_POLICY_CLASSES[n](config) for n in FIXED_POLICIES}
        self._tier_bytes = {t: b for t, b in (tier_bytes or {}).items() if b and b > 0}
        self._cheap_bytes = sum(b for t, b in self._tier_bytes.items() if t in self._cheap)
        self._state_file = state_file
        self._kept = (state_file.load() if state_file else None) or {}
        self._sims: dict[str, TierSimulation] = {}
        self._windows_unsaved = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the full-size filters and the simulations built so far (at most)."""
        with self._lock:
            sims = sum(s.nbytes for s in self._sims.values())
        return sum(p.nbytes for p in self._fixed.values()) + sims

    def choices(self) -> dict[str, str]:
        """The fixed policy each filtered tier admits as now (``"all"`` for tiers of unknown
        capacity, and those not asked about yet are left out).

        Returns:
            tier name -> policy name.
        """
        with self._lock:
            return {tier: sim.choice for tier, sim in self._sims.items()}

    def simulation_state(self) -> dict[str, dict[str, Any]]:
        """Per simulated tier: capacities, choice, decayed scores and hit ratios (a snapshot)."""
        with self._lock:
            return {
                t: {**s.snapshot(), "hit_ratios": s.hit_ratios(), "rate": s.sample.rate}
                for t, s in self._sims.items()
            }

    def record(self, keys: Iterable[bytes]) -> None:
        """Count one sighting of each key in every filter, and replay the request through each
        tier's simulation (``record`` is called once per request, with its keys in order).

        Args:
            keys: the request's block keys.
        """
        keys = list(keys)
        with self._lock:
            for policy in self._fixed.values():
                for key in keys:
                    policy._record(key)
            closed = False
            for sim in self._sims.values():
                before = sim.choice
                if sim.request(keys):
                    closed = True
                    self._windows_unsaved += 1
                    if sim.choice != before:
                        self._windows_unsaved = SAVE_EVERY_WINDOWS
            if closed and self._windows_unsaved >= SAVE_EVERY_WINDOWS:
                self._save()

    def _decide(self, key: bytes, victim: bytes | None, tier: str, nbytes: int) -> bool:
        sim = self._sims.get(tier)
        if sim is None:
            sim = self._maybe_simulate(tier, nbytes)
        choice = sim.choice if sim is not None else START_CHOICE
        return self._fixed[choice]._decide(key, victim, tier, nbytes)

    def _maybe_simulate(self, tier: str, nbytes: int) -> TierSimulation | None:
        """The tier's simulation, built now if its capacity is known (under the lock)."""
        capacity = self._tier_bytes.get(tier)
        nbytes = self._block_bytes or nbytes
        if capacity is None or nbytes <= 0 or capacity < nbytes:
            return None
        sim = TierSimulation(self.config, self._cheap_bytes // nbytes, capacity // nbytes)
        kept = self._kept.get(tier)
        if kept is not None:
            sim.restore(kept)
        self._sims[tier] = sim
        return sim

    def _save(self) -> None:
        self._windows_unsaved = 0
        if self._state_file is not None:
            kept = dict(self._kept)
            kept.update({t: s.snapshot() for t, s in self._sims.items()})
            self._state_file.save(kept)
