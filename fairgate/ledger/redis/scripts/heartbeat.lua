-- ARGV[3]: reservation id. Records a heartbeat if the reservation is open.
-- -> {'not_found'} | {'final'} | {'ok'}
local rid = ARGV[3]
local raw = call('HGET', RES, rid)
if not raw then return {'not_found'} end
if not is_open(raw) then return {'final'} end
hset_kept(HB, rid, fmt(now_ms()))
touch_all()
return {'ok'}
