"""Admission: which blocks each tier below the engine writes.

Every full block of every finished request used to go down every tier, though most are never
read again. A policy (``policy``) decides per block and per tier whether the write is worth
it, from a memory of recent block keys: a ghost queue (``ghost``, the last N distinct keys) or
a TinyLFU frequency sketch (``sketch``). The CPU tier and pinned blocks take everything.

The default is ``adaptive`` (``adaptive``, ``simulation``, ``sample``, ``state_file``): per
filtered tier it measures, on ghost tiers over a hashed sample of keys, what each fixed policy
would hit there on recent traffic, and admits as the winner, switching with hysteresis. No fixed
policy wins everywhere:

- A filter that waits for a block's second sighting cannot tell at the first which blocks
  will be used again, so it loses every hit on a block's second use that comes after the CPU
  tier dropped it: most of what a disk large enough to keep blocks that long serves.
- On a disk too small for that, one-hit blocks push reused ones out, and a filter that keeps
  them out gains hits while writing a fraction of the blocks.
- A prefix computed once before a restart would not be on disk after it, so every tier starts
  as ``all`` (or as the choice kept in the disk folder for the same capacities).

``all``, ``second_hit`` and ``tinylfu`` stay selectable. Between the filters: on a large disk
``second_hit`` (an exact window of distinct keys) keeps more hits than ``tinylfu`` at the same
``admission_tracked_keys``; ``tinylfu`` writes less and takes about a third of the memory per
key. ``cachetier report --trace`` replays each policy at each disk capacity on a trace.
"""

from cachetier.admission.adaptive import Adaptive
from cachetier.admission.config import (
    ADMISSION_POLICIES,
    DEFAULT_ADMISSION_POLICY,
    FIXED_POLICIES,
    GENERATED_MODES,
    AdmissionConfig,
)
from cachetier.admission.factory import POLICY_CLASSES, make_admission_policy
from cachetier.admission.ghost import GhostQueue
from cachetier.admission.policy import AdmissionPolicy, SecondHit, StoreAll, TinyLFU
from cachetier.admission.sample import GhostLRU, KeySample
from cachetier.admission.sketch import FrequencySketch
from cachetier.admission.state_file import STATE_FILE_NAME, AdmissionStateFile
from cachetier.admission.stats import AdmissionStats

__all__ = [
    "ADMISSION_POLICIES",
    "DEFAULT_ADMISSION_POLICY",
    "FIXED_POLICIES",
    "GENERATED_MODES",
    "POLICY_CLASSES",
    "STATE_FILE_NAME",
    "Adaptive",
    "AdmissionConfig",
    "AdmissionPolicy",
    "AdmissionStateFile",
    "AdmissionStats",
    "FrequencySketch",
    "GhostLRU",
    "GhostQueue",
    "KeySample",
    "SecondHit",
    "StoreAll",
    "TinyLFU",
    "make_admission_policy",
]
