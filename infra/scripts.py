"""Every Lua script rollouts runs on Redis, in one place.

A script is one atomic compound update (or read) on the Redis server: nothing runs between its
commands, and it reads the server's clock (`TIME`), so every process agrees on lease expiries.
Each script names its KEYS and ARGV at the top, in the order its caller passes them; the key
layouts are `infra/keys.py`'s. Callers register them with `redis.Redis.register_script`.

- `BEGIN_LUA`, `END_LUA`, `RENEW_LUA`, `BACK_OFF_LUA`: a rollout's admission (with its agent's
  adaptive window), slot release (growing the window), lease renewal, and a 429/503 reply
  (shrinking the window) (`workers/rollout/admission.py`).
- `TAKE_LEASE_LUA`, `RENEW_ROLLOUTS_LUA`, `SETTLE_LUA`, `GIVE_BACK_LUA`: a rollout's lease
  (holder, attempt, stage), its renewal with the takeover of expired leases, its settling, and
  its return by an attempt that never started (`workers/rollout/leases.py`).
- `ACQUIRE_READING_LUA`, `RELEASE_LUA`, `EXTEND_LUA`: the shard lock (`infra/locks.py`).
- `LANDED_LUA`: which keys of a batch landed, in the landed bitmaps or set
  (`workers/shard/landed.py`); `BEGIN_LUA` and `ACQUIRE_READING_LUA` start with the same function.
- `REFILL_TAKE_LUA`, `REFILL_DONE_LUA`: the queue window's refill (`workers/window.py`).
- `RUNNING_LUA`: what of a `run_examples` call still runs (`producer/api/transport.py`).
"""

from __future__ import annotations

from infra.keys import LANDED_BITS_ROLLOUTS

_LANDED_FN = f"""
-- Whether `task:rollout` landed: its bit in the rollout's bitmap (`<landed_key>_bits:<rollout>`,
-- infra/keys.shard_landed_bits), else its member in the landed set (workers/shard/landed.py).
local BITS_ROLLOUTS = {LANDED_BITS_ROLLOUTS}
local function landed(landed_key, key)
  local colon = string.find(key, ':', 1, true)
  if colon then
    local task = tonumber(string.sub(key, 1, colon - 1))
    local rollout = tonumber(string.sub(key, colon + 1))
    if task and rollout and rollout < BITS_ROLLOUTS and task < 4294967296 and
        redis.call('GETBIT', landed_key .. '_bits:' .. rollout, task) == 1 then
      return true
    end
  end
  return redis.call('SISMEMBER', landed_key, key) == 1
end
"""

BEGIN_LUA = (
    _LANDED_FN
    + """
-- Whether one delivery of a rollout may start now, and if so take its slot (a lease).
-- Returns {verdict, detail} in the words of schemas.outcomes (Admit), or wait: run, wait (a cap
-- is full: call again; detail names it: max_resident_tasks, max_concurrency or window), duplicate
-- (it landed already), fenced (another run owns the shard; detail: its token), drained (the
-- dispatch budget is spent; detail: seconds left), stopped (the run was failed or cancelled;
-- detail: 'failed: <first error>', or the cancel flag's 'cancel' or 'drain'), worker_lost
-- (workers died on it more than max_attempts times; detail: how many).
-- A readmission (readmit = 1: the delivery comes back from a rate-limit wait) keeps the start
-- it counted the first time: it counts none, and gives it back when it does not run; a drain
-- lets it go on, as it lets running calls finish.
-- The agent's adaptive window (agent_window_key, a hash: window, ssthresh, cap, last_decrease)
-- refuses a start while the agent's leases reach floor(window); it is made when missing (Redis
-- lost it, or it idled out) at the agent's max_concurrency if declared, else the initial window. Every shard key it writes expires key_ttl
-- seconds later (a live run's keys are written again, or refreshed by its producer).
local state_key, landed_key, run_failed_key, cancel_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local generation_key, counts_key, starts_key = KEYS[5], KEYS[6], KEYS[7]
local leases_key, waiting_key, agent_leases_key = KEYS[8], KEYS[9], KEYS[10]
local agent_window_key, agent_waiting_key = KEYS[11], KEYS[12]
local token, key, member, ttl = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local run_cap, agent_cap, max_attempts = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local deadline, margin, starts_keep_s = tonumber(ARGV[8]), tonumber(ARGV[9]), ARGV[10]
local readmit, default_cap = ARGV[11] == '1', tonumber(ARGV[12])
local initial_window, window_keep_s = tonumber(ARGV[13]), ARGV[14]
local key_ttl = ARGV[15] or '604800'  -- ROLLOUTS_LIVE_KEY_TTL_S's default when not passed
local probe_s = tonumber(ARGV[16] or '0.25')  -- SLOW_START_PROBE_S's default when not passed

-- The generation hash's field names are infra/generation.py's (a unit test checks them).
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local mine = redis.call('HGET', generation_key, 'token') == token
local function count(field)
  if mine then
    redis.call('HINCRBY', generation_key, field, 1)
    redis.call('EXPIRE', generation_key, key_ttl)
  end
end
local function leave()
  redis.call('ZREM', waiting_key, member)
  redis.call('ZREM', agent_waiting_key, member)
  if readmit and redis.call('HINCRBY', starts_key, key, -1) <= 0 then
    redis.call('HDEL', starts_key, key)
  end
end
local function not_started(verdict, detail)
  leave()
  if verdict == 'drained' then
    count('drained')
    redis.call('HINCRBY', counts_key, 'drained', 1)
    redis.call('EXPIRE', counts_key, key_ttl)
  else
    count('stopped')
  end
  return {verdict, detail}
end
local function wait_for(what, for_agent)
  redis.call('ZADD', waiting_key, now + ttl, member)
  redis.call('EXPIRE', waiting_key, key_ttl)
  if for_agent then redis.call('ZADD', agent_waiting_key, now + ttl, member) end
  return {'wait', what}
end
local failed = redis.call('GET', run_failed_key)
if failed then return not_started('stopped', 'failed: ' .. failed) end
local cancel = redis.call('GET', cancel_key)
if cancel and not (readmit and cancel == 'drain') then return not_started('stopped', cancel) end
local opener = redis.call('HGET', state_key, 'opener')
if opener and opener ~= token then
  leave()
  return {'fenced', opener}
end
if landed(landed_key, key) then
  leave()
  count('duplicate')
  return {'duplicate', ''}
end
if deadline > 0 and not readmit then
  local remaining = deadline - now
  if remaining <= 0 or (margin >= 0 and remaining < margin) then
    return not_started('drained', tostring(remaining))
  end
end
redis.call('ZREMRANGEBYSCORE', leases_key, '-inf', now)
if run_cap > 0 and redis.call('ZCARD', leases_key) >= run_cap then
  return wait_for('max_resident_tasks', false)
end
redis.call('ZREMRANGEBYSCORE', agent_leases_key, '-inf', now)
local agent_in_flight = redis.call('ZCARD', agent_leases_key)
if agent_cap > 0 and agent_in_flight >= agent_cap then return wait_for('max_concurrency', true) end
local cap = default_cap
if agent_cap > 0 then cap = agent_cap elseif run_cap > 0 then cap = run_cap end
local window = tonumber(redis.call('HGET', agent_window_key, 'window'))
if not window then
  -- An agent that declares max_concurrency starts there (NeMo Gym's semaphore does); one that
  -- declares none slow-starts from the initial window.
  window = agent_cap > 0 and agent_cap or math.min(initial_window, cap)
  redis.call('HSET', agent_window_key, 'window', window, 'ssthresh', cap, 'cap', cap, 'probed', now)
elseif tonumber(redis.call('HGET', agent_window_key, 'cap')) ~= cap then
  window = math.min(window, cap)
  redis.call('HSET', agent_window_key, 'window', window, 'cap', cap)
end
-- Slow start also doubles a full window that has gone probe_s with no 429/503: an agent's round
-- trip is a whole rollout (seconds to an hour), while a rate limiter answers at once.
if agent_in_flight >= math.floor(window) and probe_s > 0 then
  local ssthresh = tonumber(redis.call('HGET', agent_window_key, 'ssthresh')) or cap
  local probed = tonumber(redis.call('HGET', agent_window_key, 'probed')) or now
  local last = tonumber(redis.call('HGET', agent_window_key, 'last_decrease')) or 0
  if window < ssthresh and now - math.max(probed, last) >= probe_s then
    window = math.min(window * 2, ssthresh, cap)
    redis.call('HSET', agent_window_key, 'window', window, 'probed', now)
  end
end
redis.call('EXPIRE', agent_window_key, window_keep_s)
if agent_in_flight >= math.floor(window) then return wait_for('window', true) end
redis.call('ZREM', waiting_key, member)
redis.call('ZREM', agent_waiting_key, member)
if not readmit then
  local n = redis.call('HINCRBY', starts_key, key, 1)
  redis.call('EXPIRE', starts_key, starts_keep_s)
  if n > max_attempts then
    redis.call('HDEL', starts_key, key)
    count('done')
    return {'worker_lost', tostring(n - 1)}
  end
end
redis.call('ZADD', leases_key, now + ttl, member)
redis.call('EXPIRE', leases_key, key_ttl)
redis.call('ZADD', agent_leases_key, now + ttl, member)
return {'run', ''}
"""
)

END_LUA = """
-- Releases of many rollouts at once: each frees its slot and, once its rollout landed, takes
-- back its unfinished start and counts its outcome in the generation. ARGV[1] is how many
-- durations to keep, ARGV[2] the shard keys' expiry (of the generation and the durations).
-- KEYS come in groups of seven, a shard's and an agent's (each group once, however many of
-- the batch's releases share it); then each release is seven ARGV: its group's index (from 0),
-- member, key, token, field, duration and ok. An empty `key` frees the slot
-- only (the call ended; the accounting follows once it landed); a negative duration is none;
-- ok = '1' (the call succeeded) grows the agent's window: by one below ssthresh (slow start,
-- doubling per round trip), else by 1/window (one per round trip), up to its cap. An agent left
-- idle (no call in flight, nobody waiting for it) forgets its window, as TCP restarts an idle
-- connection's: the next burst slow-starts again, and a finished run leaves no agent state.
-- That is looked at once per group, after the releases (its sets only shrink meanwhile, so a
-- window deleted in between would have grown nothing).
-- The generation hash's field names are infra/generation.py's (a unit test checks them).
local keep, key_ttl = tonumber(ARGV[1]), ARGV[2]
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
for i = 0, (#ARGV - 2) / 7 - 1 do
  local a = i * 7 + 2
  local k = tonumber(ARGV[a + 1]) * 7
  local leases_key, agent_leases_key, starts_key = KEYS[k + 1], KEYS[k + 2], KEYS[k + 3]
  local generation_key, durations_key, agent_window_key = KEYS[k + 4], KEYS[k + 5], KEYS[k + 6]
  local member, key, token = ARGV[a + 2], ARGV[a + 3], ARGV[a + 4]
  local field, duration, ok = ARGV[a + 5], ARGV[a + 6], ARGV[a + 7]
  redis.call('ZREM', leases_key, member)
  redis.call('ZREM', agent_leases_key, member)
  if key ~= '' then
    if redis.call('HINCRBY', starts_key, key, -1) <= 0 then redis.call('HDEL', starts_key, key) end
    if redis.call('HGET', generation_key, 'token') == token then
      redis.call('HINCRBY', generation_key, field, 1)
      redis.call('EXPIRE', generation_key, key_ttl)
    end
  end
  if tonumber(duration) >= 0 then
    redis.call('LPUSH', durations_key, duration)
    redis.call('LTRIM', durations_key, 0, keep - 1)
    redis.call('EXPIRE', durations_key, key_ttl)
  end
  if ok == '1' then
    local window = tonumber(redis.call('HGET', agent_window_key, 'window'))
    if window then
      local cap = tonumber(redis.call('HGET', agent_window_key, 'cap')) or window
      local ssthresh = tonumber(redis.call('HGET', agent_window_key, 'ssthresh')) or cap
      if window < ssthresh then window = window + 1 else window = window + 1 / window end
      redis.call('HSET', agent_window_key, 'window', math.min(window, cap))
    end
  end
end
for g = 0, #KEYS / 7 - 1 do
  local agent_leases_key, agent_window_key = KEYS[g * 7 + 2], KEYS[g * 7 + 6]
  local agent_waiting_key = KEYS[g * 7 + 7]
  redis.call('ZREMRANGEBYSCORE', agent_leases_key, '-inf', now)
  redis.call('ZREMRANGEBYSCORE', agent_waiting_key, '-inf', now)
  if redis.call('ZCARD', agent_leases_key) == 0 and redis.call('ZCARD', agent_waiting_key) == 0 then
    redis.call('DEL', agent_window_key)
  end
end
return 1
"""

BACK_OFF_LUA = """
-- A /run answered 429 or 503: free the rollout's slot, count the reply, and shrink the agent's
-- window by `decrease` (multiplicative, not below 1; slow start ends there), at most once per
-- round trip: a reply to a call sent before the last decrease (now - last_decrease < call_s) saw the
-- old window and changes nothing. wait_s >= 0: the rollout now sleeps that long; it is counted
-- (per agent, in the shard's counts) and listed meanwhile as waiting, for the agent and in the
-- shard (so a run whose rollouts all sleep out a long Retry-After is not taken for stalled); a
-- negative wait_s: none follows (the rollout gave up). Returns {window, 1 if it shrank else 0}.
-- The shard keys it writes expire key_ttl seconds later.
local leases_key, agent_leases_key, agent_window_key = KEYS[1], KEYS[2], KEYS[3]
local agent_limited_key, agent_waiting_key, counts_key = KEYS[4], KEYS[5], KEYS[6]
local waiting_key = KEYS[7]
local member, call_s, wait_s = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local agent, ttl, initial_window = ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6])
local window_keep_s, limited_keep_s, decrease = ARGV[7], tonumber(ARGV[8]), tonumber(ARGV[9])
local key_ttl = ARGV[10]

local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('ZREM', leases_key, member)
redis.call('ZREM', agent_leases_key, member)
redis.call('ZADD', agent_limited_key, now, member .. '@' .. t[1] .. '.' .. t[2])
redis.call('ZREMRANGEBYSCORE', agent_limited_key, '-inf', now - limited_keep_s)
redis.call('EXPIRE', agent_limited_key, math.ceil(2 * limited_keep_s))
if wait_s >= 0 then
  redis.call('ZADD', agent_waiting_key, now + wait_s + ttl, member)
  redis.call('ZADD', waiting_key, now + wait_s + ttl, member)
  redis.call('HINCRBY', counts_key, 'rate_limit_waits:' .. agent, 1)
  redis.call('HINCRBY', counts_key, 'rate_limit_wait_ms:' .. agent, math.floor(wait_s * 1000))
  redis.call('EXPIRE', waiting_key, key_ttl)
  redis.call('EXPIRE', counts_key, key_ttl)
end
local window = tonumber(redis.call('HGET', agent_window_key, 'window')) or initial_window
local last = tonumber(redis.call('HGET', agent_window_key, 'last_decrease')) or 0
local shrank = 0
if now - last >= call_s then
  window = math.max(1, window * decrease)
  redis.call('HSET', agent_window_key, 'window', window, 'ssthresh', window, 'last_decrease', now)
  shrank = 1
end
redis.call('EXPIRE', agent_window_key, window_keep_s)
return {tostring(window), shrank}
"""

RENEW_LUA = """
-- Push the expiry of every lease this process holds to now + ttl. KEYS are the lease sorted
-- sets, ARGV[1] the ttl, ARGV[2] the expiry of the sets themselves, then one lease member per
-- key in the same order. ZADD without XX: after Redis lost its data, the leases of calls still
-- running come back.
local ttl, key_ttl = tonumber(ARGV[1]), ARGV[2]
local t = redis.call('TIME')
local expiry = tonumber(t[1]) + tonumber(t[2]) / 1000000 + ttl
for i, lease_set in ipairs(KEYS) do
  local member = ARGV[i + 2]
  redis.call('ZADD', lease_set, expiry, member)
  redis.call('EXPIRE', lease_set, key_ttl)
end
return #KEYS
"""

_MARK_FN = f"""
-- Note `task:rollout` in the keys of `set_key` (landed()'s layout): a bit of its rollout index's
-- bitmap when the task index is below `limit` (workers/shard/landed.py's rule: a bitmap holds at
-- most 2 bytes per rollout the generation enqueued), else a member of the set. Expires key_ttl.
local MARK_ROLLOUTS = {LANDED_BITS_ROLLOUTS}
local function mark(set_key, key, limit, key_ttl)
  local colon = string.find(key, ':', 1, true)
  local task = colon and tonumber(string.sub(key, 1, colon - 1))
  local rollout = colon and tonumber(string.sub(key, colon + 1))
  if task and rollout and rollout < MARK_ROLLOUTS and task < limit then
    local bits = set_key .. '_bits:' .. rollout
    redis.call('SETBIT', bits, task, 1)
    redis.call('EXPIRE', bits, key_ttl)
  else
    redis.call('SADD', set_key, key)
    redis.call('EXPIRE', set_key, key_ttl)
  end
end
"""

TAKE_LEASE_LUA = (
    _LANDED_FN
    + """
-- One delivery of a rollout asks for its lease. Returns {verdict, detail, lost}:
-- settled (it settled in this generation already: a copy), live (another attempt of this
-- generation holds a fresh lease; detail: its holder), or taken (detail: this attempt's token;
-- lost: the silent holder taken over, else ''). A lease is taken when there is none, when it
-- expired, when a takeover re-published it (stage redispatched) or when it is an older
-- generation's. The message (if any) is kept for a takeover to publish again. The shard hashes
-- it writes expire key_ttl seconds later. settled_key: the generation's (keys.shard_settled).
local lease_key, attempts_key, messages_key, settled_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local all_key = KEYS[5]
local key, token, holder, ttl, message = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5]
local member, key_ttl = ARGV[6], ARGV[7]
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
if landed(settled_key, key) then return {'settled', '', ''} end
local n, lost, was = 1, '', ''
local raw = redis.call('HGET', lease_key, key)
if raw then
  local lease = cjson.decode(raw)
  local expiry = tonumber(redis.call('ZSCORE', all_key, member) or '0')
  if lease.token == token and lease.stage ~= 'redispatched' and expiry > now then
    return {'live', lease.holder, ''}
  end
  n, lost = lease.n + 1, lease.lost
  if lease.stage ~= 'redispatched' then
    if lost ~= '' then lost = lost .. ',' end
    lost = lost .. lease.holder
  end
  was = string.match(lost, '([^,]*)$')
end
local attempt = holder .. '/' .. n .. '/' .. t[1] .. '.' .. t[2]
redis.call('HSET', lease_key, key, cjson.encode({holder = holder, attempt = attempt, n = n,
  token = token, stage = 'admitted', beat = now, ttl = ttl, lost = lost, since = now}))
redis.call('HSET', attempts_key, key, attempt)
redis.call('EXPIRE', lease_key, key_ttl)
redis.call('EXPIRE', attempts_key, key_ttl)
if message ~= '' then
  redis.call('HSET', messages_key, key, message)
  redis.call('EXPIRE', messages_key, key_ttl)
end
redis.call('ZADD', all_key, now + ttl, member)
return {'taken', attempt, was}
"""
)

RENEW_ROLLOUTS_LUA = """
-- A worker process's one round trip per interval: renew the leases it holds, then take over up
-- to `claim` expired leases of the cluster. ARGV: ttl, claim, this process's holder, the lease,
-- message and attempts hash patterns (`%s`: the sid), the expiry of the admission slots' lease
-- sets, the number n of slot leases held, n (lease set, member) pairs, then (member, attempt,
-- stage) per held rollout lease, the member being `<sid>|<task>:<rollout>`. The slot leases are
-- renewed as RENEW_LUA does. A rollout lease is renewed only while its attempt is the current
-- one. An expired lease is marked redispatched, its attempt replaced by the takeover's (the
-- silent holder is fenced from now on, before any new attempt starts), its expiry pushed by ttl
-- (if the taker dies before publishing, another takes it over later) and its message returned.
-- Returns {members no longer this process's, {member, message} per taken-over lease}.
-- The shards' keys are built here from the members (single-node Redis, as everywhere).
local all_key = KEYS[1]
local ttl, claim, holder = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
local lease_pattern, message_pattern, attempts_pattern = ARGV[4], ARGV[5], ARGV[6]
local slot_set_ttl, slots = ARGV[7], tonumber(ARGV[8])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
-- The member's layout is workers/shard/leases.py's `lease_member` (a unit test checks it).
local function split(member)
  local bar = string.find(member, '|', 1, true)
  return string.sub(member, 1, bar - 1), string.sub(member, bar + 1)
end
for i = 9, 8 + 2 * slots, 2 do
  local lease_set, slot = ARGV[i], ARGV[i + 1]
  redis.call('ZADD', lease_set, now + ttl, slot)
  redis.call('EXPIRE', lease_set, slot_set_ttl)
end
local gone = {}
for i = 9 + 2 * slots, #ARGV, 3 do
  local member, attempt, stage = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local sid, key = split(member)
  local lease_key = string.format(lease_pattern, sid)
  local raw = redis.call('HGET', lease_key, key)
  local lease = raw and cjson.decode(raw)
  if lease and lease.attempt == attempt then
    lease.stage, lease.beat = stage, now
    redis.call('HSET', lease_key, key, cjson.encode(lease))
    redis.call('ZADD', all_key, now + ttl, member)
  else
    gone[#gone + 1] = member
  end
end
local taken = {}
for _, member in ipairs(redis.call('ZRANGEBYSCORE', all_key, '-inf', now, 'LIMIT', 0, claim)) do
  local sid, key = split(member)
  local lease_key = string.format(lease_pattern, sid)
  local raw = redis.call('HGET', lease_key, key)
  local message = redis.call('HGET', string.format(message_pattern, sid), key)
  if raw and message then
    local lease = cjson.decode(raw)
    if lease.stage ~= 'redispatched' then
      if lease.lost ~= '' then lease.lost = lease.lost .. ',' end
      lease.lost = lease.lost .. lease.holder
    end
    lease.stage, lease.holder, lease.beat = 'redispatched', holder, now
    lease.attempt = 'takeover/' .. holder .. '/' .. t[1] .. '.' .. t[2]
    redis.call('HSET', lease_key, key, cjson.encode(lease))
    redis.call('HSET', string.format(attempts_pattern, sid), key, lease.attempt)
    redis.call('ZADD', all_key, now + ttl, member)
    taken[#taken + 1] = {member, message}
  else
    redis.call('ZREM', all_key, member)
  end
end
return {gone, taken}
"""

SETTLE_LUA = (
    _LANDED_FN
    + _MARK_FN
    + """
-- An attempt of a rollout ended. It settles the rollout in generation `token` unless the rollout
-- settled there already or the attempt was taken over (another is the rollout's current one):
-- then it returns {0, ''} and its outcome is void. Settling drops the lease, the message and the
-- attempt (the attempt fences the lander only while a newer one may still land), and marks the
-- rollout settled in the generation's settled_key (keys.shard_settled). With `count` = '1' (a
-- rollout of `rollouts run` or `resume`) in the generation the shard runs now, it counts toward
-- the finish: the settling that makes `counted` reach `enqueued` returns the finish task's
-- signature, for its worker to publish ({1, finish}; else {1, ''}). An `attempt` of '' is a
-- delivery that took no lease (Redis was away then): it settles and counts, and no lease goes.
-- With KEYS[7] and KEYS[8] (a Python API rollout), the settling also pushes its reply (ARGV[7])
-- onto KEYS[7], expiring ARGV[8] seconds later, and leaves the invocation's active set KEYS[8]
-- (member ARGV[9]), so the reply goes exactly when the lease is settled: once the caller saw its
-- last reply and dropped the call's keys, nothing writes them again. The keys it writes expire
-- key_ttl seconds later.
local lease_key, attempts_key, messages_key, settled_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local all_key, generation_key = KEYS[5], KEYS[6]
local key, attempt, token, member, key_ttl = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local count = ARGV[6]
local replies_key, active_key = KEYS[7], KEYS[8]
local reply, reply_ttl, index = ARGV[7], ARGV[8], ARGV[9]
if landed(settled_key, key) then return {0, ''} end
if attempt ~= '' then
  local current = redis.call('HGET', attempts_key, key)
  if current and current ~= attempt then return {0, ''} end
  redis.call('HDEL', lease_key, key)
  redis.call('HDEL', messages_key, key)
  redis.call('HDEL', attempts_key, key)
  redis.call('ZREM', all_key, member)
end
-- The generation hash's field names are infra/generation.py's (a unit test checks them).
local generation = redis.call('HMGET', generation_key, 'token', 'enqueued')
local enqueued = tonumber(generation[2] or '0') or 0
mark(settled_key, key, math.max(65536, 16 * enqueued), key_ttl)
if active_key then
  redis.call('RPUSH', replies_key, reply)
  redis.call('EXPIRE', replies_key, reply_ttl)
  redis.call('SREM', active_key, index)
end
local finish = ''
if count == '1' and generation[1] == token then
  if redis.call('HINCRBY', generation_key, 'counted', 1) == enqueued then
    finish = redis.call('HGET', generation_key, 'finish') or ''
  end
end
return {1, finish}
"""
)

ACQUIRE_READING_LUA = (
    _LANDED_FN
    + """
-- Take the shard lock and, in the same round trip, read what the holder needs first: the
-- shard's state hash and which of the batch's keys already landed.
-- Returns {1, state hash as a flat list, landed flags} when taken, else {0}.
local lock_key, state_key, landed_key = KEYS[1], KEYS[2], KEYS[3]
local token, ttl_ms = ARGV[1], ARGV[2]
if redis.call('SET', lock_key, token, 'NX', 'PX', ttl_ms) then
  local present = {}
  for i = 3, #ARGV do
    local key = ARGV[i]
    present[#present + 1] = landed(landed_key, key) and 1 or 0
  end
  return {1, redis.call('HGETALL', state_key), present}
end
return {0}
"""
)

LANDED_LUA = (
    _LANDED_FN
    + """
-- Which of the keys in ARGV landed: 1 or 0 each. KEYS[1] is the shard's landed set.
local landed_key = KEYS[1]
local present = {}
for i = 1, #ARGV do
  local key = ARGV[i]
  present[i] = landed(landed_key, key) and 1 or 0
end
return present
"""
)

GIVE_BACK_LUA = """
-- An attempt that never started gives its rollout's lease back (its worker stopped while the
-- delivery waited for a slot): the lease, its attempt and its message go if they are still this
-- attempt's, so that the next delivery takes the lease at once instead of after its expiry.
-- Nothing is settled or counted. Returns 1 if it gave the lease back, 0 if it was not its own.
local lease_key, attempts_key, messages_key, all_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local key, attempt, member = ARGV[1], ARGV[2], ARGV[3]
if redis.call('HGET', attempts_key, key) ~= attempt then return 0 end
redis.call('HDEL', lease_key, key)
redis.call('HDEL', attempts_key, key)
redis.call('HDEL', messages_key, key)
redis.call('ZREM', all_key, member)
return 1
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

REFILL_TAKE_LUA = """
-- Whether a shard's queue window (KEYS[1]) has room for its next rows, and if so take the refill
-- lock (KEYS[4], value ARGV[1], ARGV[2] ms). Unstarted tasks are those published and neither
-- settled (the generation's `counted`, KEYS[2]) nor holding a lease (KEYS[3]); a refill waits
-- for room for the share ARGV[4] of the window (or the rows left). Returns {room, cursor, published, token}:
-- room 0 is nothing to publish now; -1 is every row published, or the window's generation is no
-- longer the shard's, and the sid ARGV[3] leaves the set KEYS[5].
local window_key, generation_key, leases_key, lock_key, windows_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local holder, lock_ms, sid, share = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local w = redis.call('HMGET', window_key, 'token', 'window', 'cursor', 'published', 'total')
-- The generation hash's field names are infra/generation.py's (a unit test checks them).
local g = redis.call('HMGET', generation_key, 'token', 'counted')
local published, total = tonumber(w[4] or '0'), tonumber(w[5] or '0')
if not w[1] or g[1] ~= w[1] or published >= total then
  redis.call('SREM', windows_key, sid)
  return {-1, 0, 0, ''}
end
local window, left = tonumber(w[2]), total - published
local unstarted = published - tonumber(g[2] or '0') - redis.call('HLEN', leases_key)
local room = math.min(window - unstarted, left)
if room < math.min(math.max(1, math.floor(window * share)), left) then return {0, 0, 0, ''} end
if not redis.call('SET', lock_key, holder, 'NX', 'PX', lock_ms) then return {0, 0, 0, ''} end
return {room, tonumber(w[3]), published, w[1]}
"""

REFILL_DONE_LUA = """
-- A refill published `n` (ARGV[4]) rows from byte `from` (ARGV[2]) up to byte `to` (ARGV[3]):
-- move the window's (KEYS[1]) cursor there if it is still at `from` (else another refiller went
-- on meanwhile: the rows went twice), refresh its expiry (ARGV[5] s), and release the lock
-- (KEYS[2]) if this refiller (ARGV[1]) still holds it. A `from` of '' only releases the lock.
-- Returns 1 when the cursor moved.
local window_key, lock_key = KEYS[1], KEYS[2]
local holder, from, to, n, ttl = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local moved = 0
if from ~= '' and redis.call('HGET', window_key, 'cursor') == from then
  redis.call('HSET', window_key, 'cursor', to)
  redis.call('HINCRBY', window_key, 'published', n)
  redis.call('EXPIRE', window_key, ttl)
  moved = 1
end
if redis.call('GET', lock_key) == holder then redis.call('DEL', lock_key) end
return moved
"""
