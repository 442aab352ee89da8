"""Every restored record checked against its own tokens before its KV is used: the first layer's
K and V of a few of its tokens, recomputed (``FirstLayer``) and compared with the record's.

Which tokens are drawn at random on each check, so a record cannot be made to pass by keeping
fixed positions right. The measure is the restore guard's (``compare``): the relative error per
plane. The tolerance is the first layer's own (``FIRST_LAYER_TOLERANCE``), far tighter than a
full verification's: an honest first layer differs from the recomputation only by the rounding
of one projection, not by rounding grown through every layer, so noise that a full
verification must let pass is refused here.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from cachetier.guard.compare import PLANE_NAMES, REL_TOLERANCE, TINY_NORM, BlockMismatch, fp8_values
from cachetier.guard.first_layer import FirstLayer
from cachetier.primitives.kv_format import SCALE_DTYPE
from cachetier.record import KVBlock

# One token of each record each restore, drawn afresh: a record whose first layer is wrong at
# every token (another prompt's KV, K and V swapped, heads permuted, layer 0 zeroed) is caught
# by any of them, and the check stays near 2% of a long prompt's warm TTFT on two cores.
DEFAULT_TOKENS_PER_RECORD = 1

# The largest relative error of an honest record's first-layer K or V of one token, per dtype.
# Honest means the rounding of one RMSNorm and one projection in another order or kernel, and
# the record's own storage rounding: about 1e-6 in fp32, 1e-3 in fp16, 1e-2 in bf16 (whose
# storage alone rounds by up to 2^-8). These allow about five times that, and fp32 the error
# of a writer that multiplied in TF32 (fp16's mantissa). An fp8 record's quantization error
# is all of its error: its full-verification tolerance.
FIRST_LAYER_TOLERANCE: dict[str, float] = {
    "float32": 0.002,
    "float16": 0.01,
    "bfloat16": 0.05,
    "float8_e4m3fn": REL_TOLERANCE["float8_e4m3fn"],
    "float8_e5m2": REL_TOLERANCE["float8_e5m2"],
}
# K is rotated by its position's angles, and writers compute those angles differently (in
# fp64, or from inverse frequencies an ulp apart): the angle's error grows with the position,
# about one fp32 ulp of it. So K's tolerance grows by this much per position (1.6e-2 more at
# 131,072 tokens); V is never rotated.
ROPE_DRIFT_PER_POSITION = 2.0**-23


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
        self,
        records: Sequence[KVBlock],
        token_ids: Sequence[int],
        first_position: int,
        layer0: Layer0 | None = None,
    ) -> CheckFailure | None:
        """The first of ``records`` whose first layer is not that of its tokens.

        Args:
            records: consecutive records of one sequence, in the canonical K/V format
                (``[layers, 2, tokens, kv_heads, head_dim]``).
            token_ids: their tokens, in order (at least ``num_tokens`` per record).
            first_position: the position in the sequence of the first record's first token.
            layer0: where the caller holds the records in one tensor (an engine's pool they
                were read into): given the token offsets and a number of leading records,
                their K and V there as ``[2, records * len(offsets), kv_heads * head_dim]``
                floats, in one call instead of one per record. Used where every record has
                the same length and a float dtype.

        Returns:
            ``None`` when every record passes (or none can be checked: an MLA record, a record
            of another head shape), else the first that failed.
        """
        gathered = self._gather_at_once(records, token_ids, first_position, layer0)
        if gathered is None:
            gathered = self._gather(records, token_ids, first_position)
        if gathered is None:
            return None
        ids, positions, stored, spans, dtype = gathered
        import torch  # here: the sidecar imports cachetier without torch

        expected = self.layer.kv(torch.from_numpy(ids), torch.from_numpy(positions)).numpy()
        stored = stored.reshape(expected.shape)
        errors = _relative_errors(stored, expected, spans, uniform=dtype is not None)  # [2, R]
        tolerances = _tolerances(records, spans, dtype, positions)  # [2, R]
        past = (errors > tolerances).any(axis=0)
        self.checked_records += len(spans)
        if not past.any():
            return None
        self.failed_records += 1
        at = int(np.argmax(past))
        index = spans[at][0]
        record = records[index]
        worst = tuple(
            sorted(
                (
                    (0, PLANE_NAMES[p], float(errors[p, at]))
                    for p in range(2)
                    if errors[p, at] > tolerances[p, at]
                ),
                key=lambda x: -x[2],
            )
        )
        mismatch = BlockMismatch(
            record.key.hex(),
            record.dtype,
            float(tolerances[:, at].min()),
            worst,
            float(errors[:, at].max()),
            "values",
            record.format_version,
        )
        return CheckFailure(index, mismatch)

    def _gather_at_once(
        self,
        records: Sequence[KVBlock],
        token_ids: Sequence[int],
        first_position: int,
        layer0: Layer0 | None,
    ) -> _Gathered | None:
        """``_gather`` through ``layer0``, where it can serve every record at once (with their
        one dtype last)."""
        if layer0 is None or not records:
            return None
        n, heads, dim = records[0].num_tokens, self.layer.num_kv_heads, self.layer.head_dim
        count = len(records)
        dtype, shape = records[0].dtype, records[0].shape
        if dtype not in _FLOATS or shape[1:] != (2, n, heads, dim) or len(token_ids) < count * n:
            return None
        # Compared without a tuple per record: a long restore checks hundreds, and what the
        # check allocates is collected on the serving thread.
        if not all(r.shape == shape and r.dtype == dtype for r in records):
            return None
        offsets = np.array(sorted(self._rng.sample(range(n), min(n, self.tokens_per_record))))
        picked = (np.arange(count)[:, None] * n + offsets[None, :]).ravel()
        ids = np.asarray(token_ids[: count * n], dtype=np.int64)[picked]
        if ids.min() < 0 or ids.max() >= self.layer.vocab_size:
            return None
        k = offsets.size
        spans = _EvenSpans(count, k)
        stored = np.asarray(layer0(offsets, count), dtype=np.float32)
        return ids, picked + first_position, stored, spans, dtype

    def _gather(
        self, records: Sequence[KVBlock], token_ids: Sequence[int], first_position: int
    ) -> _Gathered | None:
        """The token ids and positions drawn (int64), the records' stored first-layer K and V
        of them (float64 ``[2, n, H * D]``), each checked record's span among them, and
        ``None`` for their dtype (not known to be one); ``None`` if no record can be checked.

        One draw of offsets serves every record of a length (a restore's records are of one
        length), and each record costs one view and one small gather: a long prompt's restore
        checks hundreds of records."""
        heads, dim = self.layer.num_kv_heads, self.layer.head_dim
        tokens = np.asarray(token_ids, dtype=np.int64)
        drawn: dict[int, np.ndarray] = {}
        bases: list[int] = []
        rows: list[np.ndarray] = []
        spans: list[tuple[int, int, int]] = []
        at = count = 0
        for index, record in enumerate(records):
            n = record.num_tokens
            base, at = at, at + n
            if record.shape[1:] != (2, n, heads, dim) or at > tokens.size:
                continue  # not a K/V record of this model's heads: nothing to compare with
            offsets = drawn.get(n)
            if offsets is None:
                k = min(n, self.tokens_per_record)
                offsets = drawn[n] = np.array(sorted(self._rng.sample(range(n), k)))
            values = _first_layer(record, offsets, heads * dim)
            if values is None:
                continue
            spans.append((index, count, count + offsets.size))
            count += offsets.size
            bases.append(base)
            rows.append(values)
        if not rows:
            return None
        sizes = np.array([end - begin for _, begin, end in spans])
        starts = np.repeat(np.array(bases), sizes)
        picked = starts + np.concatenate([drawn[records[i].num_tokens] for i, _, _ in spans])
        ids = tokens[picked]
        if ids.min() < 0 or ids.max() >= self.layer.vocab_size:
            return None  # tokens this model does not have: not its records to judge
        stored = np.concatenate(rows, axis=1).astype(np.float32)  # [2, n, H * D]
        return ids, picked + first_position, stored, spans, None


def _first_layer(record: KVBlock, offsets: np.ndarray, row: int) -> np.ndarray | None:
    """The record's first-layer K and V at token ``offsets`` (``row``: elements of one token
    of one plane), as ``[2, len(offsets), row]`` floats, an fp8 record's scaled by its first
    layer's scales; ``None`` for a dtype it cannot read."""
    dtype, n = record.dtype, record.num_tokens
    numpy_dtype = _NUMPY_DTYPES.get(dtype)
    if numpy_dtype is None:
        return None
    raw = np.frombuffer(record.data, dtype=numpy_dtype, count=2 * n * row).reshape(2, n, row)
    # One token: a view, copied once with every record's (``_gather``'s concatenate).
    first = int(offsets[0])
    picked = raw[:, first : first + 1] if offsets.size == 1 else raw[:, offsets]
    if dtype == "float32" or dtype == "float16":
        return picked  # widened once, with every record's
    if dtype == "bfloat16":
        return (picked.astype(np.uint32) << 16).view("<f4")
    values = fp8_values(dtype, picked)
    scales = np.frombuffer(record.aux, dtype=SCALE_DTYPE)
    if scales.size >= 2:
        values[0] *= scales[0]
        values[1] *= scales[1]
    return values


def _tolerances(
    records: Sequence[KVBlock],
    spans: Sequence[tuple[int, int, int]],
    dtype: str | None,
    positions: np.ndarray,
) -> np.ndarray:
    """Each checked record's tolerance for its K and V (``[2, records]``): its dtype's, and K's
    grown by the furthest position drawn in it (``ROPE_DRIFT_PER_POSITION``)."""
    # Only records of a dtype in the table are gathered (``_first_layer``, ``_FLOATS``).
    if dtype is not None:  # one dtype for all
        base = np.full(len(spans), FIRST_LAYER_TOLERANCE[dtype])
    else:
        base = np.array([FIRST_LAYER_TOLERANCE[records[i].dtype] for i, _, _ in spans])
    if isinstance(spans, _EvenSpans):  # no tuple per record (see ``_gather_at_once``)
        furthest = positions.reshape(spans.count, spans.k).max(axis=1)
    else:
        starts = np.array([begin for _, begin, _ in spans], dtype=np.int64)
        furthest = np.maximum.reduceat(positions, starts)
    return np.stack([base + furthest * ROPE_DRIFT_PER_POSITION, base])


# Token ids and positions drawn, the records' first-layer K and V there, each record's span of
# them, and the records' one dtype where the gather knows it (``None``: look at each).
_Gathered = tuple[np.ndarray, np.ndarray, np.ndarray, Sequence[tuple[int, int, int]], str | None]


class _EvenSpans(Sequence[tuple[int, int, int]]):
    """``count`` spans of ``k`` tokens each, record by record, made only where looked at."""

    def __init__(self, count: int, k: int) -> None:
        self.count, self.k = count, k

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> tuple[int, int, int]:  # type: ignore[override]
        if not 0 <= i < self.count:
            raise IndexError(i)
        return i, i * self.k, (i + 1) * self.k


Layer0 = Callable[[np.ndarray, int], np.ndarray]
"""Given token offsets and a number of records, the first layer's K and V of those leading
records at those offsets (``first_failure``)."""
_FLOATS = ("float32", "float16", "bfloat16")

# How a record's payload is viewed to gather from it (bf16 as its bits, fp8 as bytes).
_NUMPY_DTYPES = {
    "float32": "<f4",
    "float16": "<f2",
    "bfloat16": "<u2",
    "float8_e4m3fn": "u1",
    "float8_e5m2": "u1",
}


def _relative_errors(
    got: np.ndarray,
    expected: np.ndarray,
    spans: Sequence[tuple[int, int, int]],
    uniform: bool = False,
) -> np.ndarray:
    """``||got - expected|| / ||expected||`` per plane (K, V) and record (its span of the
    tokens), as ``[2, records]``; NaN counts as infinitely off. ``uniform``: the caller knows
    every span is as long."""
    planes, n = expected.shape[0], expected.shape[1]
    if uniform or (
        n % len(spans) == 0 and all(end - begin == n // len(spans) for _, begin, end in spans)
    ):
        # Every record the same tokens drawn (the usual case): one sum per record.
        diff = np.square(got - expected).reshape(planes, len(spans), -1)
        norm = np.square(expected).reshape(planes, len(spans), -1)
        diff = np.sqrt(diff.sum(axis=2, dtype=np.float64))
        norm = np.sqrt(norm.sum(axis=2, dtype=np.float64))
    else:
        diff = np.square(got - expected).reshape(planes, n, -1).sum(axis=2, dtype=np.float64)
        norm = np.square(expected).reshape(planes, n, -1).sum(axis=2, dtype=np.float64)
        starts = [begin for _, begin, _ in spans]
        diff = np.sqrt(np.add.reduceat(diff, starts, axis=1))
        norm = np.sqrt(np.add.reduceat(norm, starts, axis=1))
    errors = np.where(norm > TINY_NORM, diff / np.maximum(norm, TINY_NORM), diff)
    return np.nan_to_num(errors, nan=np.inf)
