"""Every admission policy by name, and the one place that builds a policy from its settings."""

from __future__ import annotations

from collections.abc import Mapping

from cachetier.admission.adaptive import Adaptive
from cachetier.admission.config import AdmissionConfig
from cachetier.admission.policy import FIXED_POLICY_CLASSES, AdmissionPolicy
from cachetier.admission.state_file import AdmissionStateFile

POLICY_CLASSES: dict[str, type[AdmissionPolicy]] = {Adaptive.name: Adaptive, **FIXED_POLICY_CLASSES}
"""By name, in ``ADMISSION_POLICIES`` order."""


def make_admission_policy(
    config: AdmissionConfig | None = None,
    *,
    tier_bytes: Mapping[str, int] | None = None,
    state_file: AdmissionStateFile | None = None,
    block_bytes: int | None = None,
) -> AdmissionPolicy:
    """The policy ``config.admission_policy`` names.

    Args:
        config: the settings (default: ``AdmissionConfig()``).
        tier_bytes: ``adaptive``: each tier's capacity in bytes by name (a tier left out is
            written as store-all); ignored by the fixed policies.
        state_file: ``adaptive``: where its choices are kept across restarts.
        block_bytes: ``adaptive``: bytes of a block, to count the tiers' capacities in blocks
            (default: the first block each tier is asked about).

    Returns:
        A new policy with empty memory and counts (``adaptive``: with the kept choices).
    """
    config = config or AdmissionConfig()
    if config.admission_policy == Adaptive.name:
        return Adaptive(
            config, tier_bytes=tier_bytes, state_file=state_file, block_bytes=block_bytes
        )
    return FIXED_POLICY_CLASSES[config.admission_policy](config)
