"""Every restored record checked against its own tokens before its KV is used: the first layer's
K and V of a few of its tokens, recomputed (``FirstLayer``) and compared with the record's.

Which tokens are drawn at random on each check, so a record cannot be made to pass by keeping
fixed positions right. The comparison is the restore guard's (``compare``): the relative error
per plane, against the tolerance of the record's dtype; an honest record differs only by the
order of a few sums, a wrong one by about its own size.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cachetier.guard.compare import PLANE_NAMES, REL_TOLERANCE, BlockMismatch, fp8_values
from cachetier.guard.first_layer import FirstLayer
from cachetier.primitives.kv_format import SCALE_DTYPE
from cachetier.record import KVBlock

DEFAULT_TOKENS_PER_RECORD = 4
_TINY = 1e-12


@dataclass(frozen=True, slots=True)
class CheckFailure:
    """The first record of a restore that failed its check.

    Args:
        index: its position in the records checked.
        mismatch: what differed (layer 0, K or V, and how far off).
    """

    index: int
    mismatch: BlockMismatch


class RecordCheck:
    """Checks restored records' first layer against their tokens; thread-safe.

    Args:
        layer: the model's first layer.
        tokens_per_record: tokens of each record recomputed (all of a record shorter than it).
        seed: seeds which tokens are drawn (tests); ``None`` draws from the system.
    """

    def __init__(
        self,
        layer: FirstLayer,
        tokens_per_record: int = DEFAULT_TOKENS_PER_RECORD,
        seed: int | None = None,
    ) -> None:
        if tokens_per_record <= 0:
            raise ValueError(f"tokens_per_record must be positive, got {tokens_per_record}")
        self.layer = layer
        self.tokens_per_record = tokens_per_record
        self._rng = random.Random(seed)
        self.checked_records = 0
        self.failed_records = 0

    def first_failure(
        self, records: Sequence[KVBlock], token_ids: Sequence[int], first_position: int
    ) -> CheckFailure | None:
        """The first of ``records`` whose first layer is not that of its tokens.

        Args:
            records: consecutive records of one sequence, in the canonical K/V format
                (``[layers, 2, tokens, kv_heads, head_dim]``).
            token_ids: their tokens, in order (at least ``num_tokens`` per record).
            first_position: the position in the sequence of the first record's first token.

        Returns:
            ``None`` when every record passes (or none can be checked: an MLA record, a record
            of another head shape), else the first that failed.
        """
        picks, stored, spans = self._gather(records, token_ids, first_position)
        if not picks:
            return None
        import torch  # here: the sidecar imports cachetier without torch

        ids = torch.tensor([t for t, _ in picks], dtype=torch.int64)
        positions = torch.tensor([p for _, p in picks], dtype=torch.int64)
        expected = self.layer.kv(ids, positions).double().numpy()  # [2, n, H, D]
        errors = _relative_errors(np.concatenate(stored, axis=1), expected, spans)  # [2, R]
        tolerances = np.array([REL_TOLERANCE.get(records[i].dtype, 0.01) for i, _, _ in spans])
        past = (errors > tolerances).any(axis=0)
        self.checked_records += len(spans)
        if not past.any():
            return None
        self.failed_records += 1
        at = int(np.argmax(past))
        index, tolerance = spans[at][0], float(tolerances[at])
        record = records[index]
        worst = tuple(
            sorted(
                (
                    (0, PLANE_NAMES[p], float(errors[p, at]))
                    for p in range(2)
                    if errors[p, at] > tolerance
                ),
                key=lambda x: -x[2],
            )
        )
        mismatch = BlockMismatch(
            record.key.hex(),
            record.dtype,
            tolerance,
            worst,
            float(errors[:, at].max()),
            "values",
            record.format_version,
        )
        return CheckFailure(index, mismatch)

    def _gather(
        self, records: Sequence[KVBlock], token_ids: Sequence[int], first_position: int
    ) -> tuple[list[tuple[int, int]], list[np.ndarray], list[tuple[int, int, int]]]:
        """The (token, position) pairs drawn, the records' stored first-layer K and V of them
        (each ``[2, n, H, D]`` float64), and each checked record's span among them.

        One draw of offsets serves every record of a length (a restore's records are of one
        length): the per-record work is a view and a small gather, since a long prompt's
        restore checks hundreds of records."""
        heads, dim = self.layer.num_kv_heads, self.layer.head_dim
        tokens = np.asarray(token_ids, dtype=np.int64)
        picks: list[tuple[int, int]] = []
        stored: list[np.ndarray] = []
        spans: list[tuple[int, int, int]] = []
        drawn: dict[int, list[int]] = {}
        at = 0
        for index, record in enumerate(records):
            n = record.num_tokens
            base, at = at, at + n
            if record.shape[1:] != (2, n, heads, dim) or at > tokens.size:
                continue  # not a K/V record of this model's heads: nothing to compare with
            offsets = drawn.get(n)
            if offsets is None:
                offsets = drawn[n] = sorted(
                    self._rng.sample(range(n), min(n, self.tokens_per_record))
                )
            ids = tokens[base + np.asarray(offsets)]
            values = _first_layer(record, offsets, n * heads * dim)
            if values is None or ids.min() < 0 or ids.max() >= self.layer.vocab_size:
                continue
            spans.append((index, len(picks), len(picks) + len(offsets)))
            picks += [(int(t), first_position + base + o) for t, o in zip(ids, offsets)]
            stored.append(values.reshape(2, len(offsets), heads, dim))
        return picks, stored, spans


def _first_layer(record: KVBlock, offsets: list[int], plane: int) -> np.ndarray | None:
    """The record's first-layer K and V at token ``offsets`` (``plane``: elements of one of
    them), as float64 ``[2, len(offsets), H * D]``, an fp8 record's scaled by its first
    layer's scales; ``None`` for a dtype it cannot read."""
    dtype = record.dtype
    width = {"float32": 4, "float16": 2, "bfloat16": 2}.get(dtype, 1)
    raw = np.frombuffer(record.data, dtype=np.uint8, count=2 * plane * width)
    n = record.num_tokens
    rows = raw.reshape(2, n, plane // n * width)[:, offsets]  # [2, k, H*D*width] bytes
    if dtype == "float32":
        return rows.view("<f4").astype(np.float64)
    if dtype == "float16":
        return rows.view("<f2").astype(np.float64)
    if dtype == "bfloat16":
        return (rows.view("<u2").astype(np.uint32) << 16).view("<f4").astype(np.float64)
    if not dtype.startswith("float8"):
        return None
    values = fp8_values(dtype, rows)
    scales = np.frombuffer(record.aux, dtype=SCALE_DTYPE)
    if scales.size >= 2:
        values[0] *= scales[0]
        values[1] *= scales[1]
    return values


def _relative_errors(
    got: np.ndarray, expected: np.ndarray, spans: Sequence[tuple[int, int, int]]
) -> np.ndarray:
    """``||got - expected|| / ||expected||`` per plane (K, V) and record (its span of the
    tokens), as ``[2, records]``; NaN counts as infinitely off."""
    planes, n = expected.shape[0], expected.shape[1]
    diff = np.square(got - expected).reshape(planes, n, -1).sum(axis=2)
    norm = np.square(expected).reshape(planes, n, -1).sum(axis=2)
    starts = [begin for _, begin, _ in spans]
    diff = np.sqrt(np.add.reduceat(diff, starts, axis=1))
    norm = np.sqrt(np.add.reduceat(norm, starts, axis=1))
    errors = np.where(norm > _TINY, diff / np.maximum(norm, _TINY), diff)
    return np.nan_to_num(errors, nan=np.inf)
