-- Redis Cluster, step 1 of writing a result: its own keys (one slot, the request_id's tag)
-- once (SET NX), with its wake-up push. Step 2, counting it in its job (another slot), is
-- count_results.lua, which the writer runs after this for every result of a job that
-- returned 1 or 0, so a crash between the two is mended by the redelivery.
-- KEYS: result, done. ARGV: json, ttl, job_id ('' = no job).
-- Returns {1, ''} written now; {0, status} a result of the same job (or no job to tell)
-- was there, with its status ('' for a result written before the envelope's fields were
-- ordered for result_head: the caller reads that one itself); {3, ''} a result of ANOTHER job was there;
-- 'wrongtype <role> <type>' a key holds another type, nothing written.
local rkey, dkey = KEYS[1], KEYS[2]
local ttl, job = tonumber(ARGV[2]), ARGV[3]
local t = wrong_type(rkey, 'string')
if t then return 'wrongtype result ' .. t end
t = wrong_type(dkey, 'list')
if t then return 'wrongtype done ' .. t end
if redis.call('SET', rkey, ARGV[1], 'NX', 'EX', ttl) then
  redis.call('RPUSH', dkey, '${done_token}')
  redis.call('EXPIRE', dkey, ttl)
  return {1, ''}
end
local other, status = result_head(rkey)
if job ~= '' and other ~= job then return {3, ''} end
return {0, status}
