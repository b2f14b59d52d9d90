-- Every line of a job is published. KEYS: job, stream, counted set ; ARGV: total, job_ttl
-- The stream and the counted set live as long as the job (a counted set that expired
-- first would let a redelivered request count again).
if redis.call('HGET', KEYS[1], '${F_status}') == '${S_submitting}' then
  redis.call('HSET', KEYS[1], '${F_status}', '${S_running}')
end
redis.call('HSET', KEYS[1], '${F_submitted}', ARGV[1])
local ttl = tonumber(ARGV[2])
if redis.call('TTL', KEYS[1]) < ttl then redis.call('EXPIRE', KEYS[1], ttl) end
for i = 2, 3 do
  if redis.call('EXISTS', KEYS[i]) == 1 and redis.call('TTL', KEYS[i]) < ttl then
    redis.call('EXPIRE', KEYS[i], ttl)
  end
end
return finalize(KEYS[1])
