-- ARGV[3..]: reservation id, reservation_ttl_s, from (ms; "" = now). Extends an open reservation to from + TTL.
-- -> {'not_found'} | {'final', json} | {'ok', json}
local rid, ttl_s, since = ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
local raw = call('HGET', RES, rid)
if not raw then return {'not_found'} end
local r = json_decode(raw)
if r.status ~= 'open' then return {'final', raw} end
local expires = (since or now_ms()) + ttl_s * 1000.0
r.expires_at_ms = fmt(expires)
local out = json_encode(r)
hset(RES, rid, out)
if call('ZADD', OPEN, open_score(expires), rid) == 1 then keep(OPEN) end
touch_all()
return {'ok', out}
