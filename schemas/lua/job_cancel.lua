-- Cancel a job. KEYS: job, cancel ; ARGV: ttl. Returns the status after it ('' no job).
local st = redis.call('HGET', KEYS[1], '${F_status}')
if not st then return '' end
if st == '${S_completed}' or st == '${S_completed_with_errors}' or st == '${S_cancelled}' then
  return st
end
redis.call('SET', KEYS[2], '1', 'EX', ARGV[1])
redis.call('HSET', KEYS[1], '${F_status}', '${S_cancelling}')
return finalize(KEYS[1])
