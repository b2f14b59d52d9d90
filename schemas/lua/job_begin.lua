-- Start (or find) a bulk job. KEYS: job ; ARGV: total, now_ms, input_path, sha256, job_ttl
local t = wrong_type(KEYS[1], 'hash')
if t then return {'conflict', 'wrongtype', t, ''} end
local h = redis.call('HMGET', KEYS[1], '${F_total}', '${F_status}', '${F_submitted}',
                     '${F_input_sha256}')
if h[1] then
  if tonumber(h[1]) ~= tonumber(ARGV[1]) or (h[4] and h[4] ~= ARGV[4]) then
    return {'conflict', h[2] or '', h[1], h[4] or ''}
  end
  return {'exists', h[2] or '', h[3] or '0'}
end
redis.call('HSET', KEYS[1], '${F_total}', ARGV[1], '${F_status}', '${S_submitting}',
           '${F_submitted}', '0', '${F_input_path}', ARGV[3], '${F_input_sha256}', ARGV[4])
redis.call('HSETNX', KEYS[1], '${F_created_at}', ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[5])
return {'new', '${S_submitting}', '0'}
