-- Read-only. -> the open reservations due (expires_at_ms <= now), none if the tenant is frozen.
if redis.call('EXISTS', FROZEN) == 1 then return {} end
local out = {}
for _, rid in ipairs(redis.call('ZRANGEBYSCORE', OPEN, '-inf', fmt(now_ms()))) do
  local raw = redis.call('HGET', RES, rid)
  if raw then out[#out + 1] = raw end
end
return out
