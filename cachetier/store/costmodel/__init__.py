"""Load or recompute: a per-request choice from measured tier speeds and prefill speed.

A hit in a slow but healthy tier (a sidecar over a thin link, a far Redis, a cold disk) can take
longer to read than the engine takes to compute the same tokens; on a GPU with fast prefill that
is the common case. So a prefix hit is not loaded blindly: for each split point ``k`` of the hit
(load blocks ``[0, k)``, recompute the rest with the prompt's suffix) the estimated TTFT is

    sum of reads of blocks [0, k), each tier span one call: latency + bytes x seconds-per-byte
    + prefill of tokens [cached + k x block_size, prompt end), chunk by chunk

and the smallest wins. The other shape recomputes a leading run ``[0, j)`` and loads the rest;
an engine that reads that tail while it computes the head (ours, from a tier whose reads wait
on a link slower than its compute) pays the longer of the two instead of their sum.

Both sides are measured, never configured: ``TierRates`` keeps a moving average of each tier's
round-trip latency (from lookups) and read time per byte (from real gets), ``CopyRate`` the time
per byte of the engine's own copy of what a tier read into its KV memory (a GPU's, across PCIe,
which can take longer than the disk read that brought the bytes in), and
``PrefillModel`` fits a step's seconds as ``c0 + c1 x tokens + c2 x attention`` (attention = the
sum over sequences of new tokens x mean context, the quadratic part) from the engine's own
forward passes. Until a side has been measured the plan loads everything, as before.

A refusal (recomputing hit blocks that could be loaded) is made only on evidence: the prefill
model never estimates a step longer, or at a longer context, than the steps it has measured
(``PrefillModel.covers``), and a refusal's estimated gain must beat the load by more than the
model's measured error on earlier refusals (``EstimateError``), fed back by the engine through
``CostModel.observe_outcome``.

Modules: ``rates`` (tiers' and copies' speeds), ``prefill`` (the step model and its measured
range), ``error`` (the estimates' measured error), ``plan`` (``LoadPlan`` and ``CostModel``).
"""

from cachetier.store.costmodel.error import EstimateError
from cachetier.store.costmodel.plan import CostModel, LoadPlan
from cachetier.store.costmodel.prefill import PrefillModel
from cachetier.store.costmodel.rates import CopyRate, TierRate, TierRates

__all__ = [
    "CopyRate",
    "CostModel",
    "EstimateError",
    "LoadPlan",
    "PrefillModel",
    "TierRate",
    "TierRates",
]
