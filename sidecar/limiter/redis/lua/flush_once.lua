-- Add one replica's flushed hits to a counter at most once, however often the flush is retried.
--
-- KEYS[1]: the window counter; KEYS[2]: this replica's flush marker for that counter
--          (same hash tag, so both live in one Cluster slot).
-- ARGV: flush sequence number (grows with every flush of the replica), hits, expire_at.
-- Reply: the counter's total after the call.
--
-- A flush whose reply is lost (timeout, broken connection) may or may not have run;
-- the replica retries it with the same sequence number and the same hits, and the
-- marker makes the retry a no-op if the first attempt landed. Hits are passed to
-- INCRBY as the caller's strings because Lua formats large numbers with an exponent.

local applied = tonumber(redis.call('GET', KEYS[2]) or '0')
if applied < tonumber(ARGV[1]) then
  local total = redis.call('INCRBY', KEYS[1], ARGV[2])
  if total == tonumber(ARGV[2]) then
    redis.call('EXPIREAT', KEYS[1], ARGV[3])
  end
  redis.call('SET', KEYS[2], ARGV[1], 'EXAT', ARGV[3])
  return total
end
return tonumber(redis.call('GET', KEYS[1]) or '0')
