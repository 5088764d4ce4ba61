-- Atomic all-or-nothing decision for one request; mirrors sidecar.limiter.protocol.decide
-- and the arithmetic of sidecar.limiter.algorithms (MemoryLimiter is the reference).
--
-- KEYS: three per check, in check order (repeats allowed): the counter's key (its window,
--       or a token bucket's :tat key), the previous window's key (sliding windows; else
--       the counter's key again), the ban key (checks with a ban; else the counter's key
--       again); then the key of each pending add (m of them).
-- ARGV: admit_all (0|1), n, now in Unix microseconds (0: Redis TIME), grace seconds,
--       then per check: limit, hits, role (0 enforced, 1 shadow, 2 quota), expire_at,
--       algorithm (0 fixed, 1 sliding, 2 token bucket), unit seconds, window start,
--       interval in microseconds (token bucket), ban seconds,
--       then per pending add: hits, expire_at.
-- Reply: {admitted (0|1), count of each check..., total of each pending key...}, then,
--        if any check has a ban duration, when each check's ban ends (Unix seconds; 0
--        for none), so the caller can tell a banned client when to come back.
--
-- A check's count is what its counter would hold with this request's hits: a fixed
-- window's hits; a sliding window's hits plus the previous window's, weighted by the
-- part of it the sliding window still covers and rounded down; a token bucket's tokens
-- in use once the request takes its hits (the TAT moves one interval per hit). A banned
-- counter counts limit + max(1, hits): over, whatever it holds. Over checks with a ban
-- duration are banned afterwards, unless a ban is running (it is not extended).
--
-- The clock is Redis TIME unless the caller passes one: every replica then charges and
-- refills token buckets on one clock (scripts are replicated by their effects, so TIME
-- is allowed before writes). A window's start comes from the caller's clock (it is in
-- the key), so the sliding weight is clamped to [0, 1] in case the clocks disagree.
--
-- Pending adds are hits a caller already admitted on its own (sync mode, or failure-mode
-- hits being reconciled); they are applied first and unconditionally, so the decision
-- sees them. A counter repeated in one request sees the hits of the earlier checks, as
-- MemoryLimiter does. Hits are passed to INCRBY as the caller's strings, and computed
-- numbers are written with '%.0f', because Lua formats large numbers with an exponent.
-- A window key gets its EXPIREAT when INCRBY creates it (the new total equals the hits),
-- so expiry costs one call per key and window; a bucket's key expires once it is full.

local HEADER = 4
local STRIDE = 9
local admit_all = ARGV[1] == '1'
local n = tonumber(ARGV[2])
local given_now = tonumber(ARGV[3])
local grace = tonumber(ARGV[4])
local m = #KEYS - 3 * n
local pending_base = HEADER + STRIDE * n

local now_us = nil
local function clock()
  if now_us == nil then
    if given_now > 0 then
      now_us = given_now
    else
      local time = redis.call('TIME')
      now_us = tonumber(time[1]) * 1000000 + tonumber(time[2])
    end
  end
  return now_us
end

local function digits(number)
  return string.format('%.0f', number)
end

local function add(key, hits, expire_at)
  local total = redis.call('INCRBY', key, hits)
  if total == tonumber(hits) then
    redis.call('EXPIREAT', key, expire_at)
  end
end

-- Whether a ban key holds an end still ahead (the clock is read only if it holds one).
local function banned(key)
  local ends = tonumber(redis.call('GET', key) or '0') or 0
  return ends > 0 and ends * 1000000 > clock()
end

for j = 1, m do
  local at = pending_base + 2 * (j - 1)
  if tonumber(ARGV[at + 1]) > 0 then
    add(KEYS[3 * n + j], ARGV[at + 1], ARGV[at + 2])
  end
end

local seen = {}

-- A fixed or sliding window's count; the current window's hits are remembered in seen.
local function window_count(i, at, hits)
  local key = KEYS[3 * i - 2]
  local before = seen[key]
  if before == nil then
    before = tonumber(redis.call('GET', key) or '0')
  end
  seen[key] = before + hits
  local count = before + hits
  if ARGV[at + 5] == '1' then
    local unit = tonumber(ARGV[at + 6])
    local weight = (tonumber(ARGV[at + 7]) + unit - clock() / 1000000) / unit
    weight = math.min(1, math.max(0, weight))
    count = count + math.floor(tonumber(redis.call('GET', KEYS[3 * i - 1]) or '0') * weight)
  end
  return count
end

-- A token bucket's TAT once the hits are taken, and its tokens in use then.
local function bucket_after(i, at, hits)
  local key = KEYS[3 * i - 2]
  local tat = seen[key]
  if tat == nil then
    tat = tonumber(redis.call('GET', key) or '0')
  end
  local now = clock()
  local interval = tonumber(ARGV[at + 8])
  local after = math.max(tat, now) + hits * interval
  local ahead = after - now
  if ahead > 0 then
    return after, math.ceil(ahead / interval)
  end
  return after, 0
end

local reply = {0}
local over = {}
local tats = {}
local bans = {}
local blocked = false
local quota_seen = false
local quota_all_over = true
for i = 1, n do
  local at = HEADER + STRIDE * (i - 1)
  local limit = tonumber(ARGV[at + 1])
  local hits = tonumber(ARGV[at + 2])
  local count
  if ARGV[at + 9] ~= '0' and banned(KEYS[3 * i]) then
    bans[KEYS[3 * i]] = true
    count = limit + math.max(1, hits)
    if ARGV[at + 5] == '2' then
      tats[i] = bucket_after(i, at, hits) -- charged only if spent (shadow, global shadow)
    end
  elseif ARGV[at + 5] == '2' then
    tats[i], count = bucket_after(i, at, hits)
    seen[KEYS[3 * i - 2]] = tats[i]
  else
    count = window_count(i, at, hits)
  end
  reply[i + 1] = count
  over[i] = count > limit
  local role = ARGV[at + 3]
  if role == '0' then
    blocked = blocked or over[i]
  elseif role == '2' then
    quota_seen = true
    quota_all_over = quota_all_over and over[i]
  end
end

local admitted = admit_all or not (blocked or (quota_seen and quota_all_over))
if admitted then
  reply[1] = 1
  for i = 1, n do
    local at = HEADER + STRIDE * (i - 1)
    local spend = admit_all or not over[i] or ARGV[at + 3] == '1'
    if spend and tonumber(ARGV[at + 2]) > 0 then
      if ARGV[at + 5] == '2' then
        local expires = math.ceil(tats[i] / 1000) + 1000 * grace
        redis.call('SET', KEYS[3 * i - 2], digits(tats[i]), 'PXAT', digits(expires))
      else
        add(KEYS[3 * i - 2], ARGV[at + 2], ARGV[at + 4])
      end
    end
  end
end

for i = 1, n do
  local at = HEADER + STRIDE * (i - 1)
  local key = KEYS[3 * i]
  if over[i] and ARGV[at + 9] ~= '0' and not bans[key] then
    bans[key] = true -- a ban running (or set just now) is not extended
    local ends = digits(math.ceil(clock() / 1000000 + tonumber(ARGV[at + 9])))
    redis.call('SET', key, ends, 'EXAT', ends)
  end
end

for j = 1, m do
  reply[n + 1 + j] = tonumber(redis.call('GET', KEYS[3 * n + j]) or '0')
end

local any_ban = false
for i = 1, n do
  any_ban = any_ban or ARGV[HEADER + STRIDE * (i - 1) + 9] ~= '0'
end
if any_ban then
  for i = 1, n do
    local ends = 0
    if ARGV[HEADER + STRIDE * (i - 1) + 9] ~= '0' then
      ends = tonumber(redis.call('GET', KEYS[3 * i]) or '0')
    end
    reply[n + 1 + m + i] = ends
  end
end
return reply
