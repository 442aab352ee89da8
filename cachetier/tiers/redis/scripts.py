"""Lua scripts of the single-node Redis tier: the exact LRU and the prefix probe.

Each runs atomically on one Redis. None can run on Redis Cluster: their keys hash to many slots,
and a cluster refuses a script whose keys are in more than one slot.

The scripts of the exact LRU take the same meta keys first (``meta_keys``), then the records'
keys. Besides the LRU itself they keep the pins (``pins``)::

    _pinned        set: storage keys pinned, stored or not (pin on arrival)
    _protected     set: the pinned keys stored and kept out of _lru (never a victim)
    _pinned_bytes  bytes of the records in _protected (they still count in _used)

so every record accounted for in ``_size`` is in exactly one of ``_lru`` and ``_protected``.
"""

from __future__ import annotations

META_NAMES = ("lru", "size", "used", "tick", "pinned", "protected", "pinned_bytes")
NUM_META = len(META_NAMES)


def meta_keys(key_prefix: str) -> list[str]:
    """The meta keys every script of the exact LRU takes first, in ``META_NAMES`` order.

    Args:
        key_prefix: the tier's ``key_prefix``.

    Returns:
        ``["{key_prefix}:_lru", "{key_prefix}:_size", ...]``; namespaces never start with ``_``,
        so no record can have one of these names.
    """
    return [f"{key_prefix}:_{name}" for name in META_NAMES]


# Lua shared by the scripts: the meta keys by name, and forgetting a record's accounting (its
# size, its LRU entry or its protection) if it has any. Local functions: Redis refuses scripts
# that define globals.
PRELUDE = """
local lru, sizes, used_key, tick_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local pinned, protected, pinned_bytes_key = KEYS[5], KEYS[6], KEYS[7]
local first = 8
local function forget_accounting(key)
  local size = redis.call('HGET', sizes, key)
  if size then
    redis.call('HDEL', sizes, key)
    redis.call('ZREM', lru, key)
    redis.call('DECRBY', used_key, size)
    if redis.call('SREM', protected, key) == 1 then
      redis.call('DECRBY', pinned_bytes_key, size)
    end
  end
end
"""

# KEYS: meta, k1..kn. ARGV: capacity, max pinned bytes, size1..sizen. Runs right after the SETs
# of k1..kn in the same MULTI. A pinned key is protected while the protected bytes stay within
# the bound; past it, it is an LRU entry like any other (waiting for room). Returns how many
# records were evicted.
PUT_SCRIPT = f"""{PRELUDE}
local n = #KEYS - first + 1
local tick = redis.call('INCRBY', tick_key, n) - n
local used = tonumber(redis.call('GET', used_key) or '0')
local pinned_bytes = tonumber(redis.call('GET', pinned_bytes_key) or '0')
local max_pinned = tonumber(ARGV[2])
for i = 1, n do
  local key = KEYS[first + i - 1]
  local old = redis.call('HGET', sizes, key)
  if old then
    used = used - tonumber(old)
    if redis.call('SREM', protected, key) == 1 then pinned_bytes = pinned_bytes - tonumber(old) end
  end
  local size = tonumber(ARGV[i + 2])
  redis.call('HSET', sizes, key, size)
  used = used + size
  if redis.call('SISMEMBER', pinned, key) == 1 and pinned_bytes + size <= max_pinned then
    redis.call('SADD', protected, key)
    redis.call('ZREM', lru, key)
    pinned_bytes = pinned_bytes + size
  else
    redis.call('ZADD', lru, tick + i, key)
  end
end
local capacity = tonumber(ARGV[1])
local evicted = 0
while used > capacity do
  local victim = redis.call('ZPOPMIN', lru)
  -- Nothing left to evict: only protected records are accounted for (another process may
  -- allow more pinned bytes than this one), so their bytes are all that is used.
  if #victim == 0 then used = pinned_bytes break end
  local size = redis.call('HGET', sizes, victim[1])
  if size then used = used - tonumber(size) end
  redis.call('HDEL', sizes, victim[1])
  redis.call('UNLINK', victim[1])
  evicted = evicted + 1
end
redis.call('SET', used_key, math.max(used, 0))
redis.call('SET', pinned_bytes_key, math.max(pinned_bytes, 0))
return evicted
"""

# KEYS: meta, k1..kn. Marks the records that still exist as just used, in order; forgets the
# accounting of those that expired (TTL) or were removed behind our back. XX: a protected
# record (not in _lru) stays out of it.
TOUCH_SCRIPT = f"""{PRELUDE}
local n = #KEYS - first + 1
local tick = redis.call('INCRBY', tick_key, n) - n
for i = 1, n do
  local key = KEYS[first + i - 1]
  if redis.call('EXISTS', key) == 1 then
    redis.call('ZADD', lru, 'XX', tick + i, key)
  else
    forget_accounting(key)
  end
end
return 0
"""

# KEYS: meta, k1..kn. Removes records and their accounting (their pins stay: a record stored
# again under a pinned key is protected again); returns how many of the records existed.
FORGET_SCRIPT = f"""{PRELUDE}
local removed = 0
for i = first, #KEYS do
  local key = KEYS[i]
  removed = removed + redis.call('UNLINK', key)
  forget_accounting(key)
end
return removed
"""

# KEYS: k1..kn. Length of the leading run of existing keys: one EVAL instead of an EXISTS per
# key, whose replies cost more to parse in Python than Redis takes to answer them.
LEADING_SCRIPT = """
for i = 1, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then return i - 1 end
end
return #KEYS
"""
