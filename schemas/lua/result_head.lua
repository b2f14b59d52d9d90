-- result_head(key): the job_id ('' when none) and status ('' when not found) of the result
-- stored at `key`, read from its first bytes only. A stored result can be tens of
-- megabytes (logprobs); decoding it whole to read one field made one admission call run
-- for seconds and Redis answer BUSY to everyone. The writer's JSON starts
-- {"v":1,"request_id":"..."[,"job_id":"..."],"status":"..."  (schemas.result keeps that
-- field order; ids are [A-Za-z0-9_.:-], so no escapes): 400 bytes always hold it.
local function result_head(key)
  local head = redis.call('GETRANGE', key, 0, ${head_bytes} - 1)
  local rest = string.match(head, '^{"v":1,"request_id":"[^"]*",(.*)')
  if not rest then return '', '' end
  local job = string.match(rest, '^"job_id":"([^"]*)",')
  if job then rest = string.sub(rest, #job + 13) end
  local status = string.match(rest, '^"${result_status}":"(%a+)"') or ''
  return job or '', status
end
