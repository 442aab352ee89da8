"""Which prefix hits vLLM can take when some KV cache groups keep a sliding window only, and
which blocks of those groups are worth storing.

A full-attention group needs every block of a hit. A sliding-window group of window ``W``
needs, for a hit ending at token ``P``, only the blocks holding tokens ``[P - W + 1, P)``:
vLLM's hybrid manager pads the others with its null block and never reads them. vLLM takes an
external hit only as a whole (a number of tokens for every group), so a hit may end at ``P``
only where every group holds what it needs there (``restorable_end``).

A sliding group's records are written only where some hit the scheduler will offer needs them
(``first_saved_block``): from the window before the prompt's last whole block on, which covers
the same prompt asked again (its hit ends one token short of the prompt) and every longer
prompt that extends it, the next turn of a chat.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from cachetier.connectors.vllm.kv_groups import StoredGroup
from cachetier.primitives import layer_sets
from cachetier.primitives.keys import BlockHash


def first_saved_block(group: StoredGroup, num_prompt_tokens: int) -> int:
    """The first block of a request that ``group`` stores (``layer_sets.first_saved_block``).

    Args:
        group: the KV cache group.
        num_prompt_tokens: the request's prompt length.
    """
    return layer_sets.first_saved_block(group.window, num_prompt_tokens, group.spec.block_size)


def restorable_end(
    groups: Sequence[StoredGroup],
    first: int,
    full_end: int,
    holds: Callable[[int, int, int], bool],
) -> int:
    """The last block a hit can end at (exclusive), ``first`` where none can
    (``layer_sets.restorable_end``).

    Args:
        groups: every KV cache group.
        first: blocks vLLM already has (its own prefix hit); a hit starts there.
        full_end: where the full-attention groups' stored prefix ends (the longest hit any
            end can reach), at most the request's last block before its last token.
        holds: ``holds(group_index, start, end)``: whether that group's tier holds every
            block in ``[start, end)``.
    """
    needs = [
        (group.index, lambda end, g=group: g.first_needed_block(end * g.spec.block_size))
        for group in groups
        if group.window is not None
    ]
    return layer_sets.restorable_end(needs, first, full_end, holds)


class WindowedLookup:
    """The stored hit of one request over every KV cache group, for one ask of vLLM's.

    Args:
        groups: every KV cache group.
        per_block: records per vLLM block.
        keys_of: ``keys_of(group_index, num_blocks)``: that group's keys of the request's
            first ``num_blocks`` blocks (at least), in records.
        lookup: ``lookup(group_index, keys)``: the ``(tier, records)`` runs of the leading
            stored ``keys`` in that group's namespace.
    """

    def __init__(
        self,
        groups: Sequence[StoredGroup],
        per_block: int,
        keys_of: Callable[[int, int], list[BlockHash]],
        lookup: Callable[[int, Sequence[BlockHash]], list[tuple[str, int]]],
    ) -> None:
        self._groups = groups
        self._n = per_block
        self._keys_of = keys_of
        self._lookup = lookup
        self._held: dict[tuple[int, int, int], list[tuple[str, int]]] = {}

    def hit(self, first: int, last: int) -> tuple[int, list[tuple[str, int]]]:
        """Where the longest hit after ``first`` blocks ends (at most ``last``, ``first`` for
        none), and its ``(tier, records)`` runs: those of the first full-attention group, or
        where every group keeps a window only, the whole hit in the tier of the first group's
        last record (that group's loads are its window's only)."""
        n = self._n
        full_end, spans = last, None
        for group in self._groups:
            if group.window is None:
                found = self._runs(group.index, first, last)
                full_end = min(full_end, first + sum(count for _, count in found) // n)
                spans = found if spans is None else spans
        end = restorable_end(self._groups, first, full_end, self.holds)
        if end <= first:
            return first, []
        if spans is None:
            group = self._groups[0]
            start = max(first, group.first_needed_block(end * group.spec.block_size))
            tier = self._runs(group.index, start, end)[-1][0]
            return end, [(tier, (end - first) * n)]
        return end, _cut(spans, (end - first) * n)

    def end_within(self, first: int, end: int) -> int:
        """The last block a hit after ``first`` can end at, at most ``end`` (``hit`` found
        the full-attention groups hold up to it)."""
        return restorable_end(self._groups, first, end, self.holds)

    def holds(self, group_index: int, start: int, end: int) -> bool:
        """Whether the group's tiers hold every block in ``[start, end)``."""
        found = self._runs(group_index, start, end)
        return sum(count for _, count in found) == (end - start) * self._n

    def _runs(self, group_index: int, start: int, end: int) -> list[tuple[str, int]]:
        held = self._held.get((group_index, start, end))
        if held is None:
            n = self._n
            keys = self._keys_of(group_index, end)[start * n : end * n]
            held = self._held[(group_index, start, end)] = self._lookup(group_index, keys)
        return held


def _cut(spans: list[tuple[str, int]], count: int) -> list[tuple[str, int]]:
    """The runs of the first ``count`` records."""
    out = []
    for tier, run in spans:
        if count <= 0:
            break
        out.append((tier, min(run, count)))
        count -= run
    return out
