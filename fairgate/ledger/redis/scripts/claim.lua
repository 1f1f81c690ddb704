-- rules.claim. ARGV[3..]: reservation id, owner, lease ms. Takes or renews the run claim of an open
-- reservation for owner (recording a heartbeat) unless another owner holds it unlapsed.
-- -> {'not_found'} | {'final'} | {'ok', holder, until_ms, now}
local rid, owner, lease = ARGV[3], ARGV[4], tonumber(ARGV[5])
local raw = redis.call('HGET', RES, rid)
if not raw then return {'not_found'} end
if not is_open(raw) then return {'final'} end
local now = now_ms()
local held = redis.call('HGET', CLAIMS, rid)
if held then
  local sep = string.find(held, '\n', 1, true)
  local holder, until_ms = string.sub(held, 1, sep - 1), tonumber(string.sub(held, sep + 1))
  if holder ~= owner and until_ms > now then return {'ok', holder, fmt(until_ms), fmt_time(now)} end
end
local until_ms = now + lease
local until_text = fmt(until_ms)
hset_kept(CLAIMS, rid, owner .. '\n' .. until_text)
hset_kept(HB, rid, fmt_time(now))
touch_all()
return {'ok', owner, until_text, fmt_time(now)}
