"""The feed's compound Redis updates, each one Lua script (docs/explanation/feed.md).

Every key a script writes is set to expire `ROLLOUTS_LIVE_KEY_TTL_S` after the write, as a
shard's keys are: a feed nobody reads any more goes by itself. Every script takes the feed's keys in the order of `feed_keys`: its stream, open groups, members,
delivered groups, counters and writers. A group's members are kept in a hash (`keys.feed_group`) with its
planned size in the `_size` field; each member's field is `r:<member>` for a result and
`f:<member>` for the failure row it settled with.
"""

from __future__ import annotations

from infra import keys


def feed_keys(name: str) -> list[str]:
    """The KEYS of every feed script, for feed `name`."""
    return [
        keys.feed_stream(name),
        keys.feed_open(name),
        keys.feed_members(name),
        keys.feed_delivered(name),
        keys.feed_counts(name),
        keys.feed_writers(name),
    ]


_DELIVER = """
local function deliver(prefix, group, reason)
  local gk = prefix .. group
  local flat = redis.call('HGETALL', gk)
  local rows, size = {}, '0'
  local failed = false
  for i = 1, #flat, 2 do
    local field = flat[i]
    if field == '_size' then
      size = flat[i + 1]
    else
      rows[#rows + 1] = flat[i + 1]
      if string.sub(field, 1, 2) == 'f:' then failed = true end
    end
  end
  if reason == nil then
    if failed then reason = 'failed' else reason = 'complete' end
  end
  redis.call('XADD', KEYS[1], '*', 'group', group, 'size', size, 'reason', reason,
             'members', '[' .. table.concat(rows, ',') .. ']')
  redis.call('DEL', gk)
  redis.call('ZREM', KEYS[2], group)
  redis.call('SADD', KEYS[4], group)
  redis.call('HINCRBY', KEYS[5], 'groups', 1)
  redis.call('HINCRBY', KEYS[5], 'delivered:' .. reason, 1)
end
"""

FEED_LAND_LUA = (
    _DELIVER
    + """
-- ARGV[1]: the group key prefix, ARGV[2]: the keys' TTL (seconds); then per member: group, size,
-- timeout_s, field, row.
-- Queued in the MULTI that commits the members' landing: they enter the feed as they land.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local prefix = ARGV[1]
for i = 3, #ARGV, 5 do
  local group, size, timeout = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2])
  local field, row = ARGV[i + 3], ARGV[i + 4]
  if redis.call('SADD', KEYS[3], group .. '\\0' .. string.sub(field, 3)) == 1 then
    redis.call('HINCRBY', KEYS[5], 'members', 1)
    if redis.call('SISMEMBER', KEYS[4], group) == 1 then
      redis.call('XADD', KEYS[1], '*', 'group', group, 'size', size, 'reason', 'late',
                 'members', '[' .. row .. ']')
      redis.call('HINCRBY', KEYS[5], 'groups', 1)
      redis.call('HINCRBY', KEYS[5], 'delivered:late', 1)
    else
      local gk = prefix .. group
      if redis.call('HSETNX', gk, '_size', size) == 1 then
        local due = '+inf'
        if timeout > 0 then due = now + timeout end
        redis.call('ZADD', KEYS[2], due, group)
      end
      redis.call('HSET', gk, field, row)
      if redis.call('HLEN', gk) - 1 >= tonumber(size) then
        deliver(prefix, group, nil)
      else
        redis.call('EXPIRE', gk, ARGV[2])
      end
    end
  end
end
for _, k in ipairs(KEYS) do redis.call('EXPIRE', k, ARGV[2]) end
return 1
"""
)

FEED_EXPIRE_LUA = (
    _DELIVER
    + """
-- ARGV: the group key prefix, the reason ('timeout': groups past their deadline; 'closed':
-- every open group, and the feed is marked closed, unless a shard still writes to it), at most
-- how many groups, the keys' TTL.
if ARGV[2] == 'closed' and redis.call('SCARD', KEYS[6]) > 0 then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local upto = now
if ARGV[2] == 'closed' then upto = '+inf' end
local due = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', upto, 'LIMIT', 0, tonumber(ARGV[3]))
for _, group in ipairs(due) do deliver(ARGV[1], group, ARGV[2]) end
if #due > 0 then
  for _, k in ipairs(KEYS) do redis.call('EXPIRE', k, ARGV[4]) end
end
if ARGV[2] == 'closed' and #due < tonumber(ARGV[3]) then
  redis.call('HSET', KEYS[5], 'closed', '1')
end
return #due
"""
)

FEED_ACK_LUA = """
-- ARGV: the consumer group, then entry ids. Each entry is acknowledged and deleted at once;
-- returns a flag per id: 1 for the acknowledgement that took it out of the pending list.
local out = {}
local n = 0
for i = 2, #ARGV do
  local acked = redis.call('XACK', KEYS[1], ARGV[1], ARGV[i])
  if acked == 1 then
    redis.call('XDEL', KEYS[1], ARGV[i])
    n = n + 1
  end
  out[#out + 1] = acked
end
if n > 0 then redis.call('HINCRBY', KEYS[5], 'acked', n) end
return out
"""
