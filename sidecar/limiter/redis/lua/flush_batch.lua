-- Add one replica's flushed hits to many counters at most once, and read counters back:
-- a whole flush in one call (plain Redis; in Cluster, keys of one call must share a
-- slot, so each counter goes through flush_once.lua instead).
--
-- KEYS[1]: this replica's flush marker (the sequence number of its last applied batch);
-- KEYS[2 .. n+1]: the counters to add to; KEYS[n+2 ..]: counters (or ban keys) to read.
-- ARGV[1]: this flush's sequence number (grows with every flush of the replica);
-- ARGV[2]: n; then hits and expire_at for each counter added to.
-- Reply: per key after the marker, in order, its value after the call (0 when absent),
-- or -1 when the key holds something that is not a number (nothing is added to it).
--
-- A flush whose reply is lost (timeout, broken connection) may or may not have run;
-- the replica retries the same batch with the same sequence number, and the marker
-- makes the retry read the counters without adding again. The script runs atomically,
-- so a batch lands whole or not at all. The marker lives as long as the batch's
-- counters: only the latest unacknowledged batch is ever retried. Hits are passed to
-- INCRBY as the caller's strings because Lua formats large numbers with an exponent.

local count = tonumber(ARGV[2])
local applied = tonumber(redis.call('GET', KEYS[1]) or '0') or 0
local apply = applied < tonumber(ARGV[1])
local reply = {}
local marker_expiry = 0

local function read(key)
  local value = redis.pcall('GET', key)
  if type(value) == 'table' then
    return -1
  end
  if not value then
    return 0
  end
  return tonumber(value) or -1
end

for i = 1, count do
  local key, hits, expire_at = KEYS[i + 1], ARGV[1 + 2 * i], ARGV[2 + 2 * i]
  if apply then
    local total = redis.pcall('INCRBY', key, hits)
    if type(total) == 'table' then
      reply[i] = -1
    else
      if total == tonumber(hits) then
        redis.call('EXPIREAT', key, expire_at)
      end
      reply[i] = total
    end
    marker_expiry = math.max(marker_expiry, tonumber(expire_at))
  else
    reply[i] = read(key)
  end
end
for i = count + 2, #KEYS do
  reply[i - 1] = read(KEYS[i])
end
if apply and count > 0 then
  redis.call('SET', KEYS[1], ARGV[1], 'EXAT', marker_expiry)
end
return reply
