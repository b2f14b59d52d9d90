-- Every line of a job is published. KEYS: job, stream ; ARGV: total, job_ttl
if redis.call('HGET', KEYS[1], '${F_status}') == '${S_submitting}' then
  redis.call('HSET', KEYS[1], '${F_status}', '${S_running}')
end
redis.call('HSET', KEYS[1], '${F_submitted}', ARGV[1])
local ttl = tonumber(ARGV[2])
if redis.call('TTL', KEYS[1]) < ttl then redis.call('EXPIRE', KEYS[1], ttl) end
if redis.call('EXISTS', KEYS[2]) == 1 and redis.call('TTL', KEYS[2]) < ttl then
  redis.call('EXPIRE', KEYS[2], ttl)
end
return finalize(KEYS[1])
