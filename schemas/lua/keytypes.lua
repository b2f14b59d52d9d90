-- wrong_type(key, want): nil when `key` is absent or of type `want`, else its type.
-- Scripts check every key they will write before writing any: a command that fails
-- half-way through a script leaves the writes before it in place.
local function wrong_type(key, want)
  local t = redis.call('TYPE', key)['ok']
  if t == 'none' or t == want then return nil end
  return t
end
