-- Writes many results in one call, each once (SET NX), with its wake-up push and job
-- bookkeeping. KEYS: per result (result, done, job hash, job stream, job counted set).
-- ARGV[1] = now_ms; then per result: json, ttl, status, request_id, custom_id, job_id
-- (job_id '' = no job bookkeeping).
-- A job counts each request once, by request (its counted set), not by the result key's
-- presence: a request redelivered after its result expired (result_ttl_s) writes its
-- result again but neither counts again nor adds a stream entry.
-- Returns one reply per result:
--   1  written now
--   0  a result already existed (a redelivery; same job, or no job to tell)
--   3  a result already existed from ANOTHER job (the caller records the duplicate)
--   'wrongtype <role> <type>'  a key holds another type; nothing was written for it
local out = {}
local now = ARGV[1]
for i = 0, (#KEYS / 5) - 1 do
  local k, a = i * 5, 1 + i * 6
  local rkey, dkey, jkey, skey, ckey = KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], KEYS[k + 4],
                                       KEYS[k + 5]
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
    t = wrong_type(ckey, 'set')
    if not bad and t then bad = 'counted ' .. t end
  end
  if bad then
    out[#out + 1] = 'wrongtype ' .. bad
  elseif not redis.call('SET', rkey, ARGV[a + 1], 'NX', 'EX', ttl) then
    local reply = 0
    if has_job and result_head(rkey) ~= job then reply = 3 end
    out[#out + 1] = reply
  else
    out[#out + 1] = 1
    redis.call('RPUSH', dkey, '${done_token}')
    redis.call('EXPIRE', dkey, ttl)
    if has_job and redis.call('SADD', ckey, rid) == 1 then
      redis.call('HINCRBY', jkey, status, 1)
      redis.call('HSET', jkey, '${F_updated_at}', now)
      redis.call('XADD', skey, '*', '${X_request_id}', rid, '${X_custom_id}', cid,
                 '${X_status}', status)
      if redis.call('TTL', jkey) < ttl then redis.call('EXPIRE', jkey, ttl) end
      local job_ttl = redis.call('TTL', jkey)
      for _, key in ipairs({skey, ckey}) do
        if redis.call('TTL', key) < job_ttl then redis.call('EXPIRE', key, job_ttl) end
      end
      finalize(jkey)
    end
  end
end
return out
