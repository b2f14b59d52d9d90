-- A request whose request_id already holds another job's result: its own job counts it
-- `failed` once (however often the record is redelivered) and its stream entry carries
-- the failed result inline, since the result key belongs to the other job.
-- KEYS: job hash, job stream. ARGV: request_id, custom_id, result json, now_ms, ttl.
-- Returns 1 when recorded now, 0 when it was recorded before, 'wrongtype ...' as above.
local jkey, skey = KEYS[1], KEYS[2]
local t = wrong_type(jkey, 'hash')
if t then return 'wrongtype job ' .. t end
t = wrong_type(skey, 'stream')
if t then return 'wrongtype stream ' .. t end
local ttl = tonumber(ARGV[5])
if redis.call('HSETNX', jkey, '${dup_prefix}' .. ARGV[1], ARGV[4]) == 0 then return 0 end
redis.call('HINCRBY', jkey, '${F_failed}', 1)
redis.call('HSET', jkey, '${F_updated_at}', ARGV[4])
redis.call('XADD', skey, '*', '${X_request_id}', ARGV[1], '${X_custom_id}', ARGV[2],
           '${X_status}', '${R_failed}', '${X_result}', ARGV[3])
if redis.call('TTL', jkey) < ttl then redis.call('EXPIRE', jkey, ttl) end
if redis.call('TTL', skey) < ttl then redis.call('EXPIRE', skey, ttl) end
finalize(jkey)
return 1
