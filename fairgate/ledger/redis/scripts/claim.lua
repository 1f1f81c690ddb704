-- rules.claim. ARGV[3..]: reservation id, owner, lease ms. Takes or renews the run claim of an open
-- reservation for owner (recording a heartbeat) unless another owner holds it unlapsed.
-- -> {'not_found'} | {'final'} | {'ok', holder, until_ms, now}
local rid, owner, lease = ARGV[3], ARGV[4], tonumber(ARGV[5])
local raw = call('HGET', RES, rid)
if not raw then return {'not_found'} end
if not is_open(raw) then return {'final'} end
local holder, until_text, now_text = take_claim(rid, owner, lease, now_ms(), false)
if holder == owner then touch_all() end
return {'ok', holder, until_text, now_text}
