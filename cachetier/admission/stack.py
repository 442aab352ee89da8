"""One LRU recency stack standing for LRU caches of several capacities at once.

An LRU cache of ``c`` keys holds exactly the ``c`` keys used most recently (the inclusion
property of LRU, Mattson et al. 1970), so caches of capacities ``c1 < c2 < ...`` fed the same
keys are the top ``c1``, ``c2``, ... of one stack. ``SegmentedStack`` keeps that stack cut at
the capacities into segments, each an ``OrderedDict`` (least recent first), and each key's
segment in a dictionary: a key's segment says at once which of the caches hold it, and a use
moves it to the top and spills each segment's oldest keys into the next one. A use costs one
move plus one spill per segment boundary the key crossed, where a cache per capacity costs a
lookup and a move in every one of them.

Not thread-safe: the caller holds its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from itertools import repeat

from cachetier.util.checks import positive_int


class SegmentedStack:
    """LRU caches of the given capacities, as one stack.

    Args:
        capacities: the caches' capacities in keys (any order, repeats allowed).
    """

    def __init__(self, capacities: Sequence[int]) -> None:
        for capacity in capacities:
            positive_int("capacity", capacity)
        if not capacities:
            raise ValueError("a stack needs at least one capacity")
        self.bounds = sorted(set(capacities))
        self._limits = [b - a for a, b in zip([0, *self.bounds[:-1]], self.bounds, strict=True)]
        self._segments: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in self.bounds]
        self._segment_of: dict[bytes, int] = {}

    def __len__(self) -> int:
        """Keys held (by the largest cache)."""
        return len(self._segment_of)

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._segment_of)

    def index_of(self, capacity: int) -> int:
        """The position of ``capacity`` in ``bounds`` (what ``leading_runs`` answers by)."""
        return self.bounds.index(capacity)

    def held_by(self, capacity: int) -> int:
        """Keys the cache of ``capacity`` holds."""
        end = self.index_of(capacity) + 1
        return sum(len(segment) for segment in self._segments[:end])

    def leading_runs(self, keys: Sequence[bytes]) -> list[int]:
        """Per capacity of ``bounds``, how many of ``keys``' first keys its cache holds in a
        row (the hits of a lookup that stops at its first miss). Changes nothing."""
        depth = len(self.bounds)
        runs = [len(keys)] * depth
        level = 0  # every key so far lies within the cache of bounds[level]
        for position, segment in enumerate(map(self._segment_of.get, keys, repeat(depth))):
            if segment > level:
                for index in range(level, segment):
                    runs[index] = position
                level = segment
                if level == depth:
                    break
        return runs

    def use(self, keys: Sequence[bytes]) -> None:
        """Use ``keys`` in order (the last one ends most recent): the same as a use of each in
        every cache, added where absent and the least recent key evicted past capacity."""
        top = self._segments[0]
        segment_of = self._segment_of
        segments = self._segments
        for key in keys:
            segment = segment_of.get(key)
            if segment == 0:
                top.move_to_end(key)
                continue
            if segment is not None:
                del segments[segment][key]
            top[key] = None
            segment_of[key] = 0
        self._spill()

    def _spill(self) -> None:
        """Push each segment's oldest keys past its size into the next one, top down."""
        segments, limits, segment_of = self._segments, self._limits, self._segment_of
        last = len(segments) - 1
        for index, (segment, limit) in enumerate(zip(segments, limits, strict=True)):
            over = len(segment) - limit
            if over <= 0:
                # Nothing flows further down: below here every gap a used key left was filled
                # by what came from above (a key moved up leaves one hole and pushes one key
                # into it), so the deeper segments stand as they are.
                return
            pop = segment.popitem
            if index == last:
                for _ in range(over):
                    del segment_of[pop(last=False)[0]]
                return
            below = segments[index + 1]
            for _ in range(over):
                key = pop(last=False)[0]
                below[key] = None
                segment_of[key] = index + 1
