-- Atomic all-or-nothing decision for one request; mirrors sidecar.limiter.protocol.decide.
--
-- KEYS: the window key of each check (n of them, in check order, repeats allowed),
--       then the key of each pending add (m of them).
-- ARGV: admit_all (0|1), n,
--       then per check: limit, hits, role (0 enforced, 1 shadow, 2 quota), expire_at,
--       then per pending add: hits, expire_at.
-- Reply: {admitted (0|1), would-be count of each check..., total of each pending key...}
--
-- Pending adds are hits a caller already admitted on its own (sync mode, or failure-mode
-- hits being reconciled); they are applied first and unconditionally, so the decision
-- sees them. A counter repeated in one request sees the hits of the earlier checks, as
-- MemoryLimiter does. Hits are passed to INCRBY as the caller's strings because Lua
-- formats large numbers with an exponent. A key gets its EXPIREAT when INCRBY creates
-- it (the new total equals the hits), so expiry costs one call per key and window.

local admit_all = ARGV[1] == '1'
local n = tonumber(ARGV[2])
local m = #KEYS - n
local pending_base = 2 + 4 * n

local function add(key, hits, expire_at)
  local total = redis.call('INCRBY', key, hits)
  if total == tonumber(hits) then
    redis.call('EXPIREAT', key, expire_at)
  end
end

for j = 1, m do
  local at = pending_base + 2 * (j - 1)
  if tonumber(ARGV[at + 1]) > 0 then
    add(KEYS[n + j], ARGV[at + 1], ARGV[at + 2])
  end
end

local seen = {}
local reply = {0}
local over = {}
local blocked = false
local quota_seen = false
local quota_all_over = true
for i = 1, n do
  local key = KEYS[i]
  local at = 2 + 4 * (i - 1)
  local before = seen[key]
  if before == nil then
    before = tonumber(redis.call('GET', key) or '0')
  end
  local after = before + tonumber(ARGV[at + 2])
  seen[key] = after
  reply[i + 1] = after
  over[i] = after > tonumber(ARGV[at + 1])
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
    local at = 2 + 4 * (i - 1)
    local spend = admit_all or not over[i] or ARGV[at + 3] == '1'
    if spend and tonumber(ARGV[at + 2]) > 0 then
      add(KEYS[i], ARGV[at + 2], ARGV[at + 4])
    end
  end
end

for j = 1, m do
  reply[n + 1 + j] = tonumber(redis.call('GET', KEYS[n + j]) or '0')
end
return reply
