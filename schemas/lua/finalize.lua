-- finalize(job): once every request of a running (or cancelling) job is answered, set
-- its final status; returns the status. Shared by the result writer and the producer.
local function finalize(job)
  local h = redis.call('HMGET', job, '${F_total}', '${F_succeeded}', '${F_failed}',
                      '${F_expired}', '${F_cancelled}', '${F_status}')
  local total = tonumber(h[1])
  if not total then return h[6] end
  local ok = tonumber(h[2]) or 0
  local cancelled = tonumber(h[5]) or 0
  local done = ok + (tonumber(h[3]) or 0) + (tonumber(h[4]) or 0) + cancelled
  if done >= total and (h[6] == '${S_running}' or h[6] == '${S_cancelling}') then
    local status = '${S_completed}'
    if h[6] == '${S_cancelling}' or cancelled > 0 then status = '${S_cancelled}'
    elseif done > ok then status = '${S_completed_with_errors}' end
    redis.call('HSET', job, '${F_status}', status)
    return status
  end
  return h[6]
end
