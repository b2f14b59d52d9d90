-- Start attempt ARGV[1] of a finished job's failed lines.
-- KEYS: job ; ARGV: attempt, -n_failed, -n_expired (strings: Lua would write -0)
local h = redis.call('HMGET', KEYS[1], '${F_status}', '${F_attempt}', '${F_retry_line}')
if h[1] == '${S_submitting}' and h[2] == ARGV[1] then return {'resume', h[3] or '0'} end
if h[1] ~= '${S_completed_with_errors}' then return {'busy', h[1] or ''} end
redis.call('HINCRBY', KEYS[1], '${F_failed}', ARGV[2])
redis.call('HINCRBY', KEYS[1], '${F_expired}', ARGV[3])
redis.call('HSET', KEYS[1], '${F_status}', '${S_submitting}', '${F_attempt}', ARGV[1],
           '${F_retry_line}', '0')
return {'started', '0'}
