-- A request whose request_id already holds another job's result: its own job counts it
-- `failed` once (however often the record is redelivered) and its stream entry carries
-- the failed result inline, since the result key belongs to the other job.
-- KEYS: job hash, job stream, job counted set. ARGV: request_id, custom_id, result json,
-- now_ms, ttl.
-- Returns 1 when recorded now, 0 when it was recorded (or counted otherwise: it ran in
-- this job before another job took its id) before, 'wrongtype ...' as above.
local jkey, skey, ckey = KEYS[1], KEYS[2], KEYS[3]
local t = wrong_type(jkey, 'hash')
if t then return 'wrongtype job ' .. t end
t = wrong_type(skey, 'stream')
if t then return 'wrongtype stream ' .. t end
t = wrong_type(ckey, 'set')
if t then return 'wrongtype counted ' .. t end
local ttl = tonumber(ARGV[5])
if redis.call('SADD', ckey, ARGV[1]) == 0 then return 0 end
if redis.call('HSETNX', jkey, '${dup_prefix}' .. ARGV[1], ARGV[4]) == 0 then return 0 end
redis.call('HINCRBY', jkey, '${F_failed}', 1)
redis.call('HSET', jkey, '${F_updated_at}', ARGV[4])
redis.call('XADD', skey, '*', '${X_request_id}', ARGV[1], '${X_custom_id}', ARGV[2],
           '${X_status}', '${R_failed}', '${X_result}', ARGV[3])
if redis.call('TTL', jkey) < ttl then redis.call('EXPIRE', jkey, ttl) end
local job_ttl = redis.call('TTL', jkey)
for _, key in ipairs({skey, ckey}) do
  if redis.call('TTL', key) < job_ttl then redis.call('EXPIRE', key, job_ttl) end
end
finalize(jkey)
return 1
