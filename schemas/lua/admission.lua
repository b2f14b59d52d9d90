-- What Redis knows about a micro-batch before it runs, in one round trip.
-- KEYS: per request its result key and its job's counted set (any key when it has no
-- job), then the cancel keys of the batch's jobs.
-- ARGV[1]: how many requests; then per request: request_id, job_id ('' = no job).
-- Returns one reply per request: false (not answered) or the job_id of its answer (''
-- when it has none): its own job when its job's counted set holds it (it was answered in
-- this job: not again, even if its result expired, or another job's result took its id
-- since), else the stored result's job. Then one per cancel key: 1 when the job is cancelled,
-- else 0. Keys of another type count as absent: the writer refuses them.
-- Reads at most RESULT_HEAD_BYTES of each stored result (result_head).
local out = {}
local n = tonumber(ARGV[1])
for i = 1, n do
  local rkey, ckey = KEYS[2 * i - 1], KEYS[2 * i]
  local rid, job = ARGV[2 * i], ARGV[2 * i + 1]
  if job ~= '' and redis.call('TYPE', ckey)['ok'] == 'set'
      and redis.call('SISMEMBER', ckey, rid) == 1 then
    out[i] = job  -- counted in its own job, whatever holds its result key now
  elseif redis.call('TYPE', rkey)['ok'] == 'string' then
    out[i] = result_head(rkey)
  else
    out[i] = false
  end
end
for i = 2 * n + 1, #KEYS do
  out[#out + 1] = (redis.call('TYPE', KEYS[i])['ok'] == 'string') and 1 or 0
end
return out
