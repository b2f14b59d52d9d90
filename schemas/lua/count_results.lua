-- Redis Cluster, step 2 of writing results: count results already written at their own
-- keys in their job (one slot, the job_id's tag), each once however often it is retried.
-- KEYS: job hash, job stream, job counted set. ARGV: now_ms, ttl, then per result:
-- request_id, custom_id, status. Returns how many were counted now, or
-- 'wrongtype <role> <type>' (nothing counted).
local jkey, skey, ckey = KEYS[1], KEYS[2], KEYS[3]
local t = wrong_type(jkey, 'hash')
if t then return 'wrongtype job ' .. t end
t = wrong_type(skey, 'stream')
if t then return 'wrongtype stream ' .. t end
t = wrong_type(ckey, 'set')
if t then return 'wrongtype counted ' .. t end
local now, ttl = ARGV[1], tonumber(ARGV[2])
local n = 0
for i = 3, #ARGV - 2, 3 do
  local rid, cid, status = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  if redis.call('SADD', ckey, rid) == 1 then
    redis.call('HINCRBY', jkey, status, 1)
    redis.call('XADD', skey, '*', '${X_request_id}', rid, '${X_custom_id}', cid,
               '${X_status}', status)
    n = n + 1
  end
end
if n > 0 then
  redis.call('HSET', jkey, '${F_updated_at}', now)
  if redis.call('TTL', jkey) < ttl then redis.call('EXPIRE', jkey, ttl) end
  -- the counted set lives as long as the job: a request redelivered after its result
  -- expired must still find itself counted (a set that expired with the results would
  -- count it again)
  local job_ttl = redis.call('TTL', jkey)
  for _, key in ipairs({skey, ckey}) do
    if redis.call('TTL', key) < job_ttl then redis.call('EXPIRE', key, job_ttl) end
  end
  finalize(jkey)
end
return n
