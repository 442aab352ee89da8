"""Lua scripts of the single-node Redis tier: the exact LRU and the prefix probe.

Each runs atomically on one Redis. None can run on Redis Cluster: their keys hash to many slots,
and a cluster refuses a script whose keys are in more than one slot.
"""

from __future__ import annotations

# KEYS: _lru, _size, _used, _tick, k1..kn. ARGV: capacity, size1..sizen. Runs right after the
# SETs of k1..kn in the same MULTI. Returns how many records were evicted.
PUT_SCRIPT = """
local lru, sizes, used_key, tick_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local n = #KEYS - 4
local tick = redis.call('INCRBY', tick_key, n) - n
local used = tonumber(redis.call('GET', used_key) or '0')
for i = 1, n do
  local key = KEYS[i + 4]
  local old = redis.call('HGET', sizes, key)
  if old then used = used - tonumber(old) end
  local size = tonumber(ARGV[i + 1])
  redis.call('HSET', sizes, key, size)
  redis.call('ZADD', lru, tick + i, key)
  used = used + size
end
local capacity = tonumber(ARGV[1])
local evicted = 0
while used > capacity do
  local victim = redis.call('ZPOPMIN', lru)
  if #victim == 0 then used = 0 break end
  local size = redis.call('HGET', sizes, victim[1])
  if size then used = used - tonumber(size) end
  redis.call('HDEL', sizes, victim[1])
  redis.call('UNLINK', victim[1])
  evicted = evicted + 1
end
redis.call('SET', used_key, math.max(used, 0))
return evicted
"""

# Lua shared by the scripts below: forget a record's accounting (its size, its LRU entry), if
# it has any. A local function: Redis refuses scripts that define globals.
_FORGET_ACCOUNTING = """
local function forget_accounting(lru, sizes, used_key, key)
  local size = redis.call('HGET', sizes, key)
  if size then
    redis.call('HDEL', sizes, key)
    redis.call('ZREM', lru, key)
    redis.call('DECRBY', used_key, size)
  end
end
"""

# KEYS: _lru, _size, _used, _tick, k1..kn. Marks the records that still exist as just used, in
# order; forgets the accounting of those that expired (TTL) or were removed behind our back.
TOUCH_SCRIPT = f"""{_FORGET_ACCOUNTING}
local lru, sizes, used_key, tick_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local n = #KEYS - 4
local tick = redis.call('INCRBY', tick_key, n) - n
for i = 1, n do
  local key = KEYS[i + 4]
  if redis.call('EXISTS', key) == 1 then
    redis.call('ZADD', lru, 'XX', tick + i, key)
  else
    forget_accounting(lru, sizes, used_key, key)
  end
end
return 0
"""

# KEYS: _lru, _size, _used, k1..kn. Removes records and their accounting; returns how many of
# the records existed.
FORGET_SCRIPT = f"""{_FORGET_ACCOUNTING}
local lru, sizes, used_key = KEYS[1], KEYS[2], KEYS[3]
local removed = 0
for i = 4, #KEYS do
  local key = KEYS[i]
  removed = removed + redis.call('UNLINK', key)
  forget_accounting(lru, sizes, used_key, key)
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
