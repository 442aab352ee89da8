"""Pinned records of the single-node Redis tier, kept in Redis itself.

The pins are sets and a counter next to the exact LRU (``scripts``: ``_pinned``, ``_protected``,
``_pinned_bytes``), so every process using the same Redis and ``key_prefix`` shares them: a pin
made through one process protects the record against eviction that a put of another triggers,
and an unpin through any of them unpins for all. The semantics are ``cachetier.pins.pinset``'s: a
pin of a key not stored yet protects the record once it arrives; protected bytes are bounded by
``max_pinned_bytes`` (each process checks its own bound when it pins or puts); a pin request
that would pass it is refused whole.

Each change is one Lua script, so a pin is applied in full or not at all even when Redis dies
under it. A pin whose reply was lost (Redis answered after the socket timeout) may have been
applied while the caller was told it failed: pinning again is harmless.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import redis

from cachetier.errors import PinLimitError, TierUnavailableError
from cachetier.pins.pinset import NO_PINS
from cachetier.tiers.redis.scripts import PRELUDE, meta_keys

_T = TypeVar("_T")
Call = Callable[[Callable[[redis.Redis], _T]], _T | None]
"""Runs an operation on redis-py behind the tier's breaker; ``None`` if skipped or failed."""

# KEYS: meta, k1..kn. ARGV: max pinned bytes. All or nothing: the records stored under keys not
# pinned yet, and not protected, are protected if the protected bytes stay within the bound.
# Returns {1, how many of the keys are protected now}, or {0, protected bytes, bytes the
# request adds, records it adds} when the bound refuses it (nothing changed).
PIN_SCRIPT = f"""{PRELUDE}
local pinned_bytes = tonumber(redis.call('GET', pinned_bytes_key) or '0')
local new, grow, seen = {{}}, {{}}, {{}}
local extra = 0
for i = first, #KEYS do
  local key = KEYS[i]
  if not seen[key] and redis.call('SISMEMBER', pinned, key) == 0 then
    seen[key] = true
    table.insert(new, key)
    local size = redis.call('HGET', sizes, key)
    if size and redis.call('EXISTS', key) == 1 then
      table.insert(grow, key)
      extra = extra + tonumber(size)
    end
  end
end
if #grow > 0 and pinned_bytes + extra > tonumber(ARGV[1]) then
  return {{0, pinned_bytes, extra, #grow}}
end
for _, key in ipairs(new) do redis.call('SADD', pinned, key) end
for _, key in ipairs(grow) do
  redis.call('SADD', protected, key)
  redis.call('ZREM', lru, key)
end
redis.call('INCRBY', pinned_bytes_key, extra)
local count, counted = 0, {{}}
for i = first, #KEYS do
  local key = KEYS[i]
  if not counted[key] and redis.call('SISMEMBER', protected, key) == 1 then
    counted[key] = true
    count = count + 1
  end
end
return {{1, count}}
"""

# KEYS: meta, k1..kn. Removes pins; a protected record goes back into the LRU as just used.
# Returns how many of the keys were pinned.
UNPIN_SCRIPT = f"""{PRELUDE}
local n = #KEYS - first + 1
local tick = redis.call('INCRBY', tick_key, n) - n
local removed = 0
for i = 1, n do
  local key = KEYS[first + i - 1]
  if redis.call('SREM', pinned, key) == 1 then
    removed = removed + 1
    if redis.call('SREM', protected, key) == 1 then
      local size = redis.call('HGET', sizes, key)
      if size then
        redis.call('DECRBY', pinned_bytes_key, size)
        redis.call('ZADD', lru, tick + i, key)
      end
    end
  end
end
return removed
"""


class RedisPins:
    """The pins of one Redis tier, read and changed in Redis.

    Args:
        call: runs an operation on the tier's redis-py client behind its breaker.
        key_prefix: the tier's ``key_prefix`` (the meta keys live under it).
        max_bytes: most bytes of protected records (``max_pinned_fraction`` of the capacity).
        where: Redis's url with the password redacted, for messages.
    """

    def __init__(self, call: Call[Any], key_prefix: str, max_bytes: int, where: str) -> None:
        self.max_bytes = max_bytes
        self._call = call
        self._meta = meta_keys(key_prefix)
        self._where = where
        self._last = {**NO_PINS, "max_pinned_bytes": max_bytes}

    def pin(self, skeys: Sequence[str]) -> int:
        """Pin records by storage key, all or none.

        Args:
            skeys: the records' Redis keys.

        Returns:
            How many of them are stored and protected now.

        Raises:
            PinLimitError: the stored ones would pass ``max_bytes``; nothing was pinned.
            TierUnavailableError: Redis did not run the script; nothing was pinned.
        """
        reply = self._script(PIN_SCRIPT, skeys, self.max_bytes, doing="pin")
        if int(reply[0]) == 1:
            return int(reply[1])
        pinned_bytes, extra, num_grow = (int(v) for v in reply[1:4])
        raise PinLimitError(
            f"the redis tier may hold {self.max_bytes} pinned bytes (max_pinned_fraction of its "
            f"capacity); {pinned_bytes} are pinned and these {num_grow} stored blocks add "
            f"{extra}: unpin others or raise max_pinned_fraction"
        )

    def unpin(self, skeys: Sequence[str]) -> int:
        """Remove pins by storage key; protected records become evictable again.

        Args:
            skeys: the records' Redis keys.

        Returns:
            How many of them were pinned.

        Raises:
            TierUnavailableError: Redis did not run the script; nothing was unpinned.
        """
        return int(self._script(UNPIN_SCRIPT, skeys, doing="unpin"))

    def snapshot(self, *, read: bool = True) -> dict[str, Any]:
        """``PinSet.snapshot``'s fields, read from Redis.

        Args:
            read: ask Redis; ``False`` (or a failed read) gives the last values read.

        Returns:
            ``pinned_keys``, ``pinned_blocks``, ``pinned_bytes``, ``pinned_waiting`` and
            ``max_pinned_bytes``.
        """
        pinned, protected, pinned_bytes = self._meta[4], self._meta[5], self._meta[6]

        def read_counts(client: redis.Redis) -> list[Any]:
            pipe = client.pipeline(transaction=True)  # one consistent view
            pipe.scard(pinned)
            pipe.scard(protected)
            pipe.get(pinned_bytes)
            return pipe.execute()

        found = self._call(read_counts) if read else None
        if found is not None:
            num_pinned, num_protected, nbytes = int(found[0]), int(found[1]), int(found[2] or 0)
            self._last = {
                "pinned_keys": num_pinned,
                "pinned_blocks": num_protected,
                "pinned_bytes": max(0, nbytes),
                "pinned_waiting": max(0, num_pinned - num_protected),
                "max_pinned_bytes": self.max_bytes,
            }
        return dict(self._last)

    def _script(self, script: str, skeys: Sequence[str], *args: object, doing: str) -> Any:
        meta = self._meta
        reply = self._call(
            lambda client: client.eval(script, len(meta) + len(skeys), *meta, *skeys, *args)
        )
        if reply is None:
            raise TierUnavailableError(
                f"the redis tier could not {doing} blocks: Redis at {self._where} did not run "
                "the script (down, refusing it, or skipped while the tier's circuit breaker is "
                f"open; see the tier's errors); nothing was {doing}ned there, try again"
            )
        return reply
