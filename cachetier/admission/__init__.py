"""Admission: which blocks each tier below the engine writes.

Every full block of every finished request used to go down every tier, though most are never
read again. A policy (``policy``) decides per block and per tier whether the write is worth
it, from a memory of recent block keys: a ghost queue (``ghost``, the last N distinct keys) or
a TinyLFU frequency sketch (``sketch``). The CPU tier and pinned blocks take everything.

The default is ``all``, today's behaviour, and the filters are for operators who choose the
trade: ``cachetier report --trace`` replays each policy at each disk capacity and shows hits
against writes. Why no filter is the default:

- A filter that waits for a block's second sighting cannot tell at the first which blocks
  will be used again. On the shipped conversation trace nothing the store sees separates
  them (the block's place in the prompt, the prompt's length, the answer's length, whether
  the prompt continues an earlier one): in every group a minority of the new blocks is used
  again.
- So a filter loses every hit on a block's second use that comes after the CPU tier dropped
  it, and those are most of what a disk tier serves once it is large enough to keep blocks
  until their second use. The replay shows filters writing a small fraction of store-all's
  blocks at every capacity, gaining hits on a disk too small to keep blocks that long anyway
  (one-hit blocks no longer push reused ones out) and losing several points of hit rate on a
  disk large enough: none stays within half a point of store-all at every capacity, whatever
  the CPU tier's size.
- A prefix computed once before a restart would not be on disk after it: the warm restart
  the disk tier exists for needs the first sighting written.

Between the filters: on a large disk ``second_hit`` (an exact window of distinct keys) keeps
more hits than ``tinylfu`` at the same ``admission_tracked_keys``; ``tinylfu`` writes less and
takes about a third of the memory per key. Choose one where a lower tier's writes cost more
than its hits: an SSD's endurance, a Redis's memory, a workload that seldom hits.
"""

from cachetier.admission.config import (
    ADMISSION_POLICIES,
    DEFAULT_ADMISSION_POLICY,
    GENERATED_MODES,
    AdmissionConfig,
)
from cachetier.admission.ghost import GhostQueue
from cachetier.admission.policy import (
    POLICY_CLASSES,
    AdmissionPolicy,
    SecondHit,
    StoreAll,
    TinyLFU,
    make_admission_policy,
)
from cachetier.admission.sketch import FrequencySketch
from cachetier.admission.stats import AdmissionStats

__all__ = [
    "ADMISSION_POLICIES",
    "DEFAULT_ADMISSION_POLICY",
    "GENERATED_MODES",
    "POLICY_CLASSES",
    "AdmissionConfig",
    "AdmissionPolicy",
    "AdmissionStats",
    "FrequencySketch",
    "GhostQueue",
    "SecondHit",
    "StoreAll",
    "TinyLFU",
    "make_admission_policy",
]
