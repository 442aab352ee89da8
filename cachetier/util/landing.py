"""Where a payload fetched by ``get_into`` lands: a flat buffer, or equal runs scattered in one.

Most engines keep a block's canonical runs in canonical order, and a tier reads a payload into
their memory as one flat buffer. Some order them otherwise: LMCache's chunk object is ``[K/V,
layers, tokens, heads x dim]`` where the canonical block is ``[layers, K/V, tokens, heads,
dim]``. For those, ``Runs`` says where each run of the payload goes, and a tier reads each run
straight to its place: the record stays canonical, and no transposing copy follows the read
(measured on LMCache's 5.6 MiB chunks: that copy cost as much as the read itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias


@dataclass(frozen=True)
class Runs:
    """A payload's destination cut into equal runs, each placed anywhere in one buffer.

    Args:
        buffer: the destination's flat writable bytes, exactly the payload's size.
        run_bytes: bytes per run.
        offsets: where in ``buffer`` each run of the payload goes, in payload order; together
            the runs cover ``buffer`` exactly once.

    Raises:
        ValueError: runs that do not tile ``buffer`` exactly once.
    """

    buffer: memoryview
    run_bytes: int
    offsets: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.buffer.format != "B" or self.buffer.ndim != 1 or self.buffer.readonly:
            raise ValueError("a Runs buffer is flat writable bytes (memoryview.cast('B'))")
        if self.run_bytes <= 0 or len(self.offsets) * self.run_bytes != self.buffer.nbytes:
            raise ValueError(
                f"{len(self.offsets)} runs of {self.run_bytes} bytes do not fill "
                f"{self.buffer.nbytes} bytes"
            )
        if sorted(self.offsets) != list(range(0, self.buffer.nbytes, self.run_bytes)):
            raise ValueError("run offsets must tile the buffer, each run once")

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes

    def parts(self) -> list[memoryview]:
        """The destination of each run, in payload order."""
        size = self.run_bytes
        return [self.buffer[offset : offset + size] for offset in self.offsets]


Destination: TypeAlias = memoryview | Runs
"""One payload's destination in ``Tier.get_into``: flat bytes, or ``Runs``."""


def flat(dest: Destination) -> memoryview:
    """The bytes a payload landed in ``dest`` occupies: what the returned block's ``data`` is."""
    if isinstance(dest, Runs):
        return dest.buffer
    view = dest if isinstance(dest, memoryview) else memoryview(dest)
    # The view itself when it already is flat bytes: callers tell by identity that it was filled.
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def normalize(dest: Destination) -> Destination:
    """``dest`` as a tier passes it on: ``Runs`` as they are, any other buffer as flat bytes."""
    return dest if isinstance(dest, Runs) else flat(dest)


def parts(dest: Destination) -> list[memoryview]:
    """Where the payload's bytes go, in payload order."""
    return dest.parts() if isinstance(dest, Runs) else [flat(dest)]


def copy_pairs(dest: Destination, payload: memoryview) -> list[tuple[memoryview, memoryview]]:
    """``(destination, source)`` pairs that land a flat ``payload`` (the dest's size) in
    ``dest``."""
    if not isinstance(dest, Runs):
        return [(flat(dest), payload)]
    out, start = [], 0
    for part in dest.parts():
        out.append((part, payload[start : start + part.nbytes]))
        start += part.nbytes
    return out
