-- Writes many results in one call, each once (SET NX), with its wake-up push and job
-- bookkeeping. KEYS: per result (result, done, job hash, job stream).
-- ARGV[1] = now_ms; then per result: json, ttl, status, request_id, custom_id, job_id
-- (job_id '' = no job bookkeeping).
-- Returns one reply per result:
--   1  written now
--   0  a result already existed (a redelivery; same job, or no job to tell)
--   3  a result already existed from ANOTHER job (the caller records the duplicate)
--   'wrongtype <role> <type>'  a key holds another type; nothing was written for it
local out = {}
local now = ARGV[1]
for i = 0, (#KEYS / 4) - 1 do
  local k, a = i * 4, 1 + i * 6
  local rkey, dkey, jkey, skey = KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], KEYS[k + 4]
  local ttl = tonumber(ARGV[a + 2])
  local status, rid, cid, job = ARGV[a + 3], ARGV[a + 4], ARGV[a + 5], ARGV[a + 6]
  local has_job = job ~= ''
  local bad = nil
  local t = wrong_type(rkey, 'string')
  if t then bad = 'result ' .. t end
  t = wrong_type(dkey, 'list')
  if not bad and t then bad = 'done ' .. t end
  if has_job and not bad then
    t = wrong_type(jkey, 'hash')
    if t then bad = 'job ' .. t end
    t = wrong_type(skey, 'stream')
    if not bad and t then bad = 'stream ' .. t end
  end
  if bad then
    out[#out + 1] = 'wrongtype ' .. bad
  elseif not redis.call('SET', rkey, ARGV[a + 1], 'NX', 'EX', ttl) then
    local reply = 0
    if has_job then
      local ok, existing = pcall(cjson.decode, redis.call('GET', rkey))
      local other = ok and type(existing) == 'table' and existing['job_id'] or nil
      if other ~= job then reply = 3 end
    end
    out[#out + 1] = reply
  else
    out[#out + 1] = 1
    redis.call('RPUSH', dkey, '${done_token}')
    redis.call('EXPIRE', dkey, ttl)
    if has_job then
      redis.call('HINCRBY', jkey, status, 1)
      redis.call('HSET', jkey, '${F_updated_at}', now)
      redis.call('XADD', skey, '*', '${X_request_id}', rid, '${X_custom_id}', cid,
                 '${X_status}', status)
      if redis.call('TTL', jkey) < ttl then redis.call('EXPIRE', jkey, ttl) end
      if redis.call('TTL', skey) < ttl then redis.call('EXPIRE', skey, ttl) end
      finalize(jkey)
    end
  end
end
return out
