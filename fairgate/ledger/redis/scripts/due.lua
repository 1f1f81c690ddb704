-- Read-only. -> the open reservations due (expires_at_ms <= now), none if the tenant is frozen. OPEN's scores are
-- whole ms at or above expires_at_ms (open_score; a fraction written by other versions of the scripts):
-- those up to now rounded up, each then checked against its record.
if call('EXISTS', FROZEN) == 1 then return {} end
local now = now_ms()
local out = {}
for _, rid in ipairs(call('ZRANGEBYSCORE', OPEN, '-inf', fmt(ceil(now)))) do
  local raw = call('HGET', RES, rid)
  if raw and tonumber(json_decode(raw).expires_at_ms) <= now then out[#out + 1] = raw end
end
return out
