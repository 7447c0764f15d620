"""Every Lua script rollouts runs on Redis, in one place.

A script is one atomic compound update (or read) on the Redis server: nothing runs between its
commands, and it reads the server's clock (`TIME`), so every process agrees on lease expiries.
Each script names its KEYS and ARGV at the top, in the order its caller passes them; the key
layouts are `infra/keys.py`'s. Callers register them with `redis.Redis.register_script`.

- `BEGIN_LUA`, `END_LUA`, `RENEW_LUA`: a rollout's admission, slot release and lease renewal
  (`workers/admission.py`).
- `ACQUIRE_READING_LUA`, `RELEASE_LUA`, `EXTEND_LUA`: the shard lock (`infra/locks.py`).
- `RUNNING_LUA`: what of a `run_examples` call still runs (`producer/api/transport.py`).
"""

from __future__ import annotations

BEGIN_LUA = """
-- Whether one delivery of a rollout may start now, and if so take its slot (a lease).
-- Returns {verdict, detail} in the words of schemas.outcomes (Admit), or wait: run, wait (a cap
-- is full: call again; detail names it), duplicate (it landed already), fenced (another run
-- owns the shard; detail: its token), drained (the dispatch budget is spent; detail: seconds
-- left), stopped (the run was failed or cancelled; detail: 'failed: <first error>', or the
-- cancel flag's 'cancel' or 'drain'), worker_lost (workers died on it more than max_attempts
-- times; detail: how many).
local state_key, landed_key, run_failed_key, cancel_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local generation_key, counts_key, starts_key = KEYS[5], KEYS[6], KEYS[7]
local leases_key, waiting_key, agent_leases_key = KEYS[8], KEYS[9], KEYS[10]
local token, key, member, ttl = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local run_cap, agent_cap, max_attempts = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local deadline, margin, starts_keep_s = tonumber(ARGV[8]), tonumber(ARGV[9]), ARGV[10]

local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local mine = redis.call('HGET', generation_key, 'token') == token
local function count(field)
  if mine then redis.call('HINCRBY', generation_key, field, 1) end
end
local function not_started(verdict, detail)
  redis.call('ZREM', waiting_key, member)
  if verdict == 'drained' then
    count('drained')
    redis.call('HINCRBY', counts_key, 'drained', 1)
  else
    count('stopped')
  end
  return {verdict, detail}
end
local failed = redis.call('GET', run_failed_key)
if failed then return not_started('stopped', 'failed: ' .. failed) end
local cancel = redis.call('GET', cancel_key)
if cancel then return not_started('stopped', cancel) end
local opener = redis.call('HGET', state_key, 'opener')
if opener and opener ~= token then
  redis.call('ZREM', waiting_key, member)
  return {'fenced', opener}
end
if redis.call('SISMEMBER', landed_key, key) == 1 then
  redis.call('ZREM', waiting_key, member)
  count('duplicate')
  return {'duplicate', ''}
end
if deadline > 0 then
  local remaining = deadline - now
  if remaining <= 0 or (margin >= 0 and remaining < margin) then
    return not_started('drained', tostring(remaining))
  end
end
redis.call('ZREMRANGEBYSCORE', leases_key, '-inf', now)
if run_cap > 0 and redis.call('ZCARD', leases_key) >= run_cap then
  redis.call('ZADD', waiting_key, now + ttl, member)
  return {'wait', 'max_resident_tasks'}
end
if agent_cap > 0 then
  redis.call('ZREMRANGEBYSCORE', agent_leases_key, '-inf', now)
  if redis.call('ZCARD', agent_leases_key) >= agent_cap then
    redis.call('ZADD', waiting_key, now + ttl, member)
    return {'wait', 'max_concurrency'}
  end
end
redis.call('ZREM', waiting_key, member)
local n = redis.call('HINCRBY', starts_key, key, 1)
redis.call('EXPIRE', starts_key, starts_keep_s)
if n > max_attempts then
  redis.call('HDEL', starts_key, key)
  count('done')
  return {'worker_lost', tostring(n - 1)}
end
redis.call('ZADD', leases_key, now + ttl, member)
if agent_cap > 0 then redis.call('ZADD', agent_leases_key, now + ttl, member) end
return {'run', ''}
"""

END_LUA = """
-- Releases of many rollouts at once: each frees its slot and, once its rollout landed, takes
-- back its unfinished start and counts its outcome in the generation. ARGV[1] is how many
-- durations to keep; then five KEYS and five ARGV per release. An empty `key` frees the slot
-- only (the call ended; the accounting follows once it landed); a negative duration is none.
local keep = tonumber(ARGV[1])
for i = 0, #KEYS / 5 - 1 do
  local k, a = i * 5, i * 5 + 1
  local leases_key, agent_leases_key, starts_key = KEYS[k + 1], KEYS[k + 2], KEYS[k + 3]
  local generation_key, durations_key = KEYS[k + 4], KEYS[k + 5]
  local member, key, token = ARGV[a + 1], ARGV[a + 2], ARGV[a + 3]
  local field, duration = ARGV[a + 4], ARGV[a + 5]
  redis.call('ZREM', leases_key, member)
  redis.call('ZREM', agent_leases_key, member)
  if key ~= '' then
    if redis.call('HINCRBY', starts_key, key, -1) <= 0 then redis.call('HDEL', starts_key, key) end
    if redis.call('HGET', generation_key, 'token') == token then
      redis.call('HINCRBY', generation_key, field, 1)
    end
  end
  if tonumber(duration) >= 0 then
    redis.call('LPUSH', durations_key, duration)
    redis.call('LTRIM', durations_key, 0, keep - 1)
  end
end
return 1
"""

RENEW_LUA = """
-- Push the expiry of every lease this process holds to now + ttl. KEYS are the lease sorted
-- sets, ARGV[1] the ttl, then one lease member per key in the same order. ZADD without XX:
-- after Redis lost its data, the leases of calls still running come back.
local ttl = tonumber(ARGV[1])
local t = redis.call('TIME')
local expiry = tonumber(t[1]) + tonumber(t[2]) / 1000000 + ttl
for i, lease_set in ipairs(KEYS) do
  local member = ARGV[i + 1]
  redis.call('ZADD', lease_set, expiry, member)
end
return #KEYS
"""

ACQUIRE_READING_LUA = """
-- Take the shard lock and, in the same round trip, read what the holder needs first: the
-- shard's state hash and which of the batch's keys already landed.
-- Returns {1, state hash as a flat list, landed flags} when taken, else {0}.
local lock_key, state_key, landed_key = KEYS[1], KEYS[2], KEYS[3]
local token, ttl_ms = ARGV[1], ARGV[2]
if redis.call('SET', lock_key, token, 'NX', 'PX', ttl_ms) then
  local present = {}
  if #ARGV > 2 then
    present = redis.call('SMISMEMBER', landed_key, unpack(ARGV, 3))
  end
  return {1, redis.call('HGETALL', state_key), present}
end
return {0}
"""

RELEASE_LUA = """
-- Release the lock if this holder (token) still has it; a lock that expired and was taken by
-- another holder is left alone.
local lock_key = KEYS[1]
local token = ARGV[1]
if redis.call('GET', lock_key) == token then return redis.call('DEL', lock_key) end
return 0
"""

EXTEND_LUA = """
-- Extend the lock's expiry to ttl_ms from now if this holder (token) still has it.
local lock_key = KEYS[1]
local token, ttl_ms = ARGV[1], ARGV[2]
if redis.call('GET', lock_key) == token then return redis.call('PEXPIRE', lock_key, ttl_ms) end
return 0
"""

RUNNING_LUA = """
-- How many rollouts of a run_examples call still run: live leases plus started-but-unreplied
-- rollouts. A running rollout is in one or the other from its admission until its reply (the
-- lease is taken by admission, the active mark is set before the call and cleared with it).
local leases_key, active_key = KEYS[1], KEYS[2]
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
return redis.call('ZCOUNT', leases_key, now, '+inf') + redis.call('SCARD', active_key)
"""
