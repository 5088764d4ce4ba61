-- One replica's turn on one quota bucket shared across replicas: publish, compute, pick up.
--
-- The reference is sidecar/quota/shares.py (step, fair_shares, grants): this script does
-- the same, atomically, and a test runs both on the same inputs.
--
-- KEYS[1]: the bucket's replicas hash: replica id -> "demand held held_until grant seen"
-- KEYS[2]: the bucket's meta hash: master, master_until, unsettled, computed_at, slack
-- KEYS[3]: the window's admitted counter (windowed buckets), else KEYS[2] again
-- (all three share the bucket's hash tag: one Cluster slot)
-- ARGV: replica, now_ms (0: Redis TIME), demand (-1 poll, -2 leave), limit, lease_ms,
--       stale_ms, master_ms, threshold_pct, min_gap_ms, window (-1: not windowed),
--       used_add, keep_ms (how long the hashes outlive the last call), used_keep_ms,
--       master_gap_ms, hold_ms (how long past its end a lease stays reserved once its
--       replica stopped calling: it may be cut off from Redis, not dead)
-- Every number is clamped first (shares.clamped does the same): the limit to [0, 2^48],
-- a demand to at most the limit, admitted requests to [0, limit], durations to [0, 2^45].
-- The window's counter never exceeds the limit (a client's 2^64-1 cannot overflow it).
-- Reply: {grant, replicas, unsettled, master, computed, capacity, others, silent}
-- (others: an upper bound of what the other replicas' leases and grants hold, capacity -
-- slack - the caller's lease; the caller's safe capacity leaves it to them while Redis is away;
-- silent: what the last computation kept reserved for silent replicas, dead or cut off)
--
-- Cost: O(1) for a replica that only publishes and picks up; O(R log R) for a computation:
-- by the bucket's master once per master_gap_ms, and by a caller that is new, whose demand
-- moved, or while shares move, at most once per min_gap_ms.

local MAX_UNITS = 281474976710656 -- 2^48
local MAX_MS = 35184372088832 -- 2^45

-- A whole number in [low, high] (garbage and NaN read as low).
local function clamp(text, low, high)
  local x = tonumber(text)
  if not x or x ~= x then
    return low
  end
  x = math.floor(x)
  if x < low then
    return low
  end
  if x > high then
    return high
  end
  return x
end

local me = ARGV[1]
local now = clamp(ARGV[2], 0, MAX_MS)
if now == 0 then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local limit = clamp(ARGV[4], 0, MAX_UNITS)
local demand = tonumber(ARGV[3])
if demand ~= -1 and demand ~= -2 then -- not a poll nor a leave: units wanted
  demand = clamp(ARGV[3], 0, limit)
end
local lease_ms = clamp(ARGV[5], 0, MAX_MS)
local stale_ms = clamp(ARGV[6], 0, MAX_MS)
local master_ms = clamp(ARGV[7], 0, MAX_MS)
local threshold = clamp(ARGV[8], 0, 1000)
local min_gap = clamp(ARGV[9], 0, MAX_MS)
local window = clamp(ARGV[10], -1, MAX_MS)
local used_add = clamp(ARGV[11], 0, limit)
local keep_ms = clamp(ARGV[12], 1, MAX_MS)
local used_keep_ms = clamp(ARGV[13], 1, MAX_MS)
local master_gap = clamp(ARGV[14], 0, MAX_MS)
local hold_ms = clamp(ARGV[15], 0, MAX_MS)

local function int(x)
  return string.format('%.0f', x)
end

local function decode(text)
  local v = {}
  for part in string.gmatch(text, '%S+') do
    v[#v + 1] = tonumber(part)
  end
  return {demand = v[1], held = v[2], until_ = v[3], grant = v[4], seen = v[5]}
end

local function encode(e)
  return int(e.demand) .. ' ' .. int(e.held) .. ' ' .. int(e.until_) .. ' ' .. int(e.grant) .. ' ' .. int(e.seen)
end

-- Byte order, as Python compares the ids' UTF-8 (Lua's < follows the server's locale).
local function before(a, b)
  local la, lb = #a, #b
  for k = 1, math.min(la, lb) do
    local x, y = string.byte(a, k), string.byte(b, k)
    if x ~= y then
      return x < y
    end
  end
  return la < lb
end

local function fair(ids, demands, capacity)
  table.sort(ids, function(a, b)
    if demands[a] ~= demands[b] then
      return demands[a] < demands[b]
    end
    return before(a, b)
  end)
  local shares = {}
  local left = math.max(0, capacity)
  local n = #ids
  for i = 1, n do
    local r = ids[i]
    local rest = n - i + 1
    local equal = math.floor(left / rest)
    local wanted = math.max(0, demands[r])
    if wanted > equal then
      local extra = left - equal * rest
      for j = i, n do
        shares[ids[j]] = equal + ((j - i < extra) and 1 or 0)
      end
      return shares
    end
    shares[r] = wanted
    left = left - wanted
  end
  if n > 0 and left > 0 then
    local spread = math.floor(left * n / (n + 1))
    local each = math.floor(spread / n)
    local extra = spread - each * n
    for i = 1, n do
      shares[ids[i]] = shares[ids[i]] + each + ((i - 1 < extra) and 1 or 0)
    end
  end
  return shares
end

local function grants(ids, targets, reserved, capacity)
  local free = capacity
  for _, r in ipairs(ids) do
    free = free - reserved[r]
  end
  local result, missing, wanted = {}, {}, 0
  for _, r in ipairs(ids) do
    if targets[r] <= reserved[r] then
      result[r] = targets[r]
    else
      missing[r] = targets[r] - reserved[r]
      wanted = wanted + missing[r]
    end
  end
  local room = math.max(0, free)
  for r, need in pairs(missing) do
    if wanted <= free then
      result[r] = targets[r]
    else
      result[r] = reserved[r] + math.floor(need * room / wanted)
    end
  end
  return result
end

local meta = {}
local raw = redis.call('HGETALL', KEYS[2])
for i = 1, #raw, 2 do
  meta[raw[i]] = raw[i + 1]
end
local master_id = meta['master'] or ''
local master_until = tonumber(meta['master_until'] or '0')
local unsettled = meta['unsettled'] == '1'
local computed_at = tonumber(meta['computed_at'] or '-4503599627370496')
local slack = tonumber(meta['slack'] or '0')
local silent = tonumber(meta['silent'] or '0')

local function recompute(capacity)
  local all = redis.call('HGETALL', KEYS[1])
  local ids, entries, demands, reserved = {}, {}, {}, {}
  local held_silent = 0
  for i = 1, #all, 2 do
    local r, e = all[i], decode(all[i + 1])
    local fresh = e.seen > now - stale_ms
    local live = e.until_ + hold_ms > now -- dead or cut off: held for the hold too
    if not fresh and not live then
      redis.call('HDEL', KEYS[1], r)
    else
      ids[#ids + 1] = r
      entries[r] = e
      -- A silent replica asks for what it holds until its hold ends (see shares._recompute).
      if fresh then
        demands[r] = e.demand
      elseif live then
        demands[r] = e.held
      else
        demands[r] = 0
      end
      reserved[r] = live and e.held or 0
      if not fresh then
        held_silent = held_silent + reserved[r]
      end
    end
  end
  local targets = fair(ids, demands, capacity)
  local offers = grants(ids, targets, reserved, capacity)
  local moving, taken = false, 0
  for _, r in ipairs(ids) do
    local e = entries[r]
    taken = taken + math.max(reserved[r], offers[r])
    if offers[r] ~= targets[r] or reserved[r] > offers[r] then
      moving = true
    end
    if e.grant ~= offers[r] then
      e.grant = offers[r]
      redis.call('HSET', KEYS[1], r, encode(e))
    end
  end
  unsettled = moving
  computed_at = now
  slack = math.max(0, capacity - taken)
  silent = held_silent
end

local function save_meta()
  redis.call('HSET', KEYS[2], 'master', master_id, 'master_until', int(master_until),
    'unsettled', unsettled and '1' or '0', 'computed_at', int(computed_at), 'slack', int(slack),
    'silent', int(silent))
  redis.call('PEXPIRE', KEYS[2], keep_ms)
end

if demand == -2 then
  if redis.call('HDEL', KEYS[1], me) == 1 then
    unsettled = true
    save_meta()
  end
  return {0, redis.call('HLEN', KEYS[1]), unsettled and 1 or 0, 0, 0, 0, 0, silent}
end

local text = redis.call('HGET', KEYS[1], me)
local new = not text
local entry = text and decode(text) or {demand = 0, held = 0, until_ = 0, grant = 0, seen = 0}
local moved = false
if demand >= 0 then
  moved = math.abs(demand - entry.demand) * 100 > threshold * math.max(entry.demand, 1)
  entry.demand = demand
  entry.seen = now
end
local capacity = limit
if window >= 0 then
  -- Never past the limit: a spent window is spent, and the counter cannot overflow.
  local used = math.min(limit, (tonumber(redis.call('GET', KEYS[3])) or 0) + used_add)
  redis.call('SET', KEYS[3], int(used), 'PX', used_keep_ms)
  capacity = math.max(0, limit - used)
  entry.held = math.max(0, entry.held - used_add)
end
-- Written before a computation, so it sees this call's demand (and a new replica).
redis.call('HSET', KEYS[1], me, encode(entry))
redis.call('PEXPIRE', KEYS[1], keep_ms)

local master = master_id == me or master_until <= now
if master then
  master_id, master_until = me, now + master_ms
end
local age = now - computed_at
local computed = (master and age >= master_gap) or (age >= min_gap and (new or moved or unsettled))
if computed then
  recompute(capacity)
  local again = redis.call('HGET', KEYS[1], me)
  if again then
    entry = decode(again)
  else -- a poll from a record gone stale and unleased
    entry.grant = 0
  end
elseif new then
  entry.grant = math.min(math.max(0, entry.demand), slack, math.floor(capacity / redis.call('HLEN', KEYS[1])))
  slack = slack - entry.grant
  unsettled = true
elseif moved then
  unsettled = true
end
local held = (entry.until_ + hold_ms > now) and entry.held or 0
entry.held, entry.until_ = entry.grant, now + lease_ms
redis.call('HSET', KEYS[1], me, encode(entry))
if entry.grant < held and unsettled and (computed or now - computed_at >= min_gap) then
  recompute(capacity)
  computed = true
end
save_meta()
local others = math.max(0, capacity - slack - entry.held)
return {entry.held, redis.call('HLEN', KEYS[1]), unsettled and 1 or 0, master and 1 or 0, computed and 1 or 0, capacity,
  others, silent}
