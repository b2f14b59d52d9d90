-- What Redis knows about a micro-batch before it runs, in one round trip.
-- KEYS: the result keys of the batch, then the cancel keys of its jobs.
-- ARGV[1]: how many of KEYS are result keys.
-- Returns one reply per key: for a result key, false (no result) or the job_id of the
-- result already there ('' when it has none); for a cancel key, 1 when the job is
-- cancelled, else 0. Keys of another type count as absent: the writer refuses them.
local out = {}
local n = tonumber(ARGV[1])
for i, key in ipairs(KEYS) do
  local t = redis.call('TYPE', key)['ok']
  if i <= n then
    if t == 'string' then
      local ok, existing = pcall(cjson.decode, redis.call('GET', key))
      local job = ok and type(existing) == 'table' and existing['job_id'] or nil
      if type(job) ~= 'string' then job = '' end
      out[i] = job
    else
      out[i] = false
    end
  else
    out[i] = (t == 'string') and 1 or 0
  end
end
return out
