"""A TinyLFU frequency sketch of recent block keys: how often each was seen, lately.

Three parts, after Einziger, Friedman and Manes (TinyLFU, ACM ToS 2017):

- a **doorkeeper**, a Bloom filter that absorbs a key's first sighting, so the many keys seen
  once (most blocks of most traces) never reach the counters;
- a **count-min sketch** of 4-bit counters (4 rows) that counts the later sightings; a key's
  estimate is the smallest of its 4 counters, plus one if the doorkeeper holds it;
- **aging**: after ``tracked_keys`` sightings every counter is halved and the doorkeeper is
  cleared, so the estimate follows what is frequent now, not what was frequent once.

Block keys are sha256 digests (``cachetier.primitives.keys.BlockHash``), already uniform, so
the positions are read straight from the key's bytes: no second hash, and the same positions in
every process (Python's ``hash()`` of bytes is salted per process).

Sizes are powers of two: a row has ``4 * next_pow2(tracked_keys)`` counters, so that a
window's sightings load each counter well under one on average and the minimum of four rarely
overstates a key; the doorkeeper has 8 bits per tracked key and sets 3 of them. In all about 9
bytes per tracked key (``nbytes``). Not thread-safe: ``cachetier.admission.policy`` holds a lock.
"""

from __future__ import annotations

from cachetier.util.checks import positive_int

ROWS = 4
COUNTERS_PER_KEY = 4  # per row, for each tracked key
DOORKEEPER_BITS_PER_KEY = 8
DOORKEEPER_PROBES = 3  # bits set per key (``_door_bits_of``)
MAX_COUNT = 15  # 4-bit counters
MAX_TRACKED_KEYS = 1 << 28  # 2.25 GiB of sketch: past that a setting is a typo
MIN_KEY_BYTES = 16
_MASK64 = (1 << 64) - 1
# Halves both 4-bit counters of a byte at once: each nibble shifted right, the bit that
# crossed from the high nibble into the low one cleared.
_HALVE = bytes(((b >> 1) & 0x77) for b in range(256))


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 << max(n - 1, 0).bit_length()


def key_words(key: bytes) -> tuple[int, int]:
    """Two 64-bit words of a block key, the second odd (a step for double hashing).

    Args:
        key: a block key (a digest of at least ``MIN_KEY_BYTES`` bytes).

    Returns:
        ``(first 8 bytes, next 8 bytes | 1)`` as little-endian integers.

    Raises:
        ValueError: a key shorter than ``MIN_KEY_BYTES`` (not a digest).
    """
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"a block key is a digest of >= {MIN_KEY_BYTES} bytes, got {len(key)}")
    word = int.from_bytes(key[:16], "little")
    return word & _MASK64, (word >> 64) | 1


class FrequencySketch:
    """Estimated recent sightings of each key, in a fixed number of bytes.

    Args:
        tracked_keys: sightings per aging period, and the number of distinct keys the sketch
            is sized to tell apart.
    """

    def __init__(self, tracked_keys: int) -> None:
        positive_int("tracked_keys", tracked_keys)
        if tracked_keys > MAX_TRACKED_KEYS:
            raise ValueError(f"tracked_keys must be <= {MAX_TRACKED_KEYS:,}, got {tracked_keys:,}")
        self.tracked_keys = tracked_keys
        self._width = COUNTERS_PER_KEY * next_pow2(tracked_keys)  # counters per row
        self._counters = bytearray(ROWS * self._width // 2)  # two 4-bit counters a byte
        self._door_bits = DOORKEEPER_BITS_PER_KEY * next_pow2(tracked_keys)
        self._door = bytearray(self._door_bits // 8)
        self._sightings = 0
        self.num_resets = 0

    @property
    def nbytes(self) -> int:
        """Bytes the counters and the doorkeeper take (fixed at construction)."""
        return len(self._counters) + len(self._door)

    def record(self, key: bytes) -> None:
        """Count one sighting of ``key`` (ages the sketch every ``tracked_keys`` sightings).

        Args:
            key: the block key.
        """
        h1, h2 = key_words(key)
        if self._door_add(h1, h2):  # seen before: the doorkeeper let it through
            self._increment(h1, h2)
        self._sightings += 1
        if self._sightings >= self.tracked_keys:
            self._age()

    def estimate(self, key: bytes) -> int:
        """Recent sightings of ``key``, as estimated (never fewer than recorded since the
        last aging; can be more, rarely, where other keys share all its counters).

        Args:
            key: the block key.

        Returns:
            0 to ``MAX_COUNT + 1``.
        """
        h1, h2 = key_words(key)
        counters, width = self._counters, self._width
        low = MAX_COUNT
        for row in range(ROWS):
            index = row * width + ((h1 + row * h2) & (width - 1))
            low = min(low, (counters[index >> 1] >> ((index & 1) << 2)) & 0xF)
            if not low:
                break
        return low + self._door_has(h1, h2)

    def _increment(self, h1: int, h2: int) -> None:
        counters, width = self._counters, self._width
        for row in range(ROWS):
            index = row * width + ((h1 + row * h2) & (width - 1))
            shift = (index & 1) << 2
            byte = counters[index >> 1]
            if (byte >> shift) & 0xF < MAX_COUNT:
                counters[index >> 1] = byte + (1 << shift)

    def _door_bits_of(self, h1: int, h2: int) -> tuple[int, int, int]:
        # Other bits of the key than the counters' low ones: the doorkeeper's probes start
        # from the words' high halves.
        a = (h1 >> 32) | ((h2 >> 32) << 32)
        b = ((h2 * 0x9E3779B97F4A7C15) & _MASK64) | 1
        mask = self._door_bits - 1
        return a & mask, (a + b) & mask, (a + 2 * b) & mask

    def _door_add(self, h1: int, h2: int) -> bool:
        """Set the key's bits; whether they were all set already."""
        door, held = self._door, True
        for bit in self._door_bits_of(h1, h2):
            mask = 1 << (bit & 7)
            if not door[bit >> 3] & mask:
                held = False
                door[bit >> 3] |= mask
        return held

    def _door_has(self, h1: int, h2: int) -> int:
        door = self._door
        for bit in self._door_bits_of(h1, h2):
            if not door[bit >> 3] & (1 << (bit & 7)):
                return 0
        return 1

    def _age(self) -> None:
        self._counters[:] = self._counters.translate(_HALVE)
        self._door[:] = bytes(len(self._door))
        self._sightings = 0
        self.num_resets += 1
