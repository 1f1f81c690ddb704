-- Read-only. ARGV[3]: window_s. -> {events in [since, first whole minute), the buckets of the whole minutes
-- (JSON amounts), flat status counts} (usage_minutes.py). A tenant without buckets yet (events older than
-- them and none since): every event of the window, no buckets.
local now = now_ms()
local since = now - tonumber(ARGV[3]) * 1000.0
if call('EXISTS', MINUTES) == 0 then
  return {call('ZRANGEBYSCORE', EVENTS, fmt(since), '+inf'), {}, call('HGETALL', STATUS)}
end
local first = ceil(since / MINUTE_MS)  -- the exact ceiling: the division may round either way
if (first - 1) * MINUTE_MS >= since then first = first - 1 end
if first * MINUTE_MS < since then first = first + 1 end
local edge = call('ZRANGEBYSCORE', EVENTS, fmt(since), '(' .. fmt(first * MINUTE_MS))
local last = max(minute_of(now), num(call('HGET', MINUTES, 'hi')) or first)
local buckets = {}
if last - first + 1 <= call('HLEN', MINUTES) then  -- the window's minutes, one field each
  local fields = {}
  for m = first, last do fields[#fields + 1] = fmt(m) end
  for i = 1, #fields, 1000 do
    local got = call('HMGET', MINUTES, unpack(fields, i, min(i + 999, #fields)))
    for _, raw in ipairs(got) do if raw then buckets[#buckets + 1] = raw end end
  end
else  -- a window longer than the tenant's history: every bucket, those before the window left out
  local flat = call('HGETALL', MINUTES)
  for i = 1, #flat, 2 do
    if flat[i] ~= 'hi' and tonumber(flat[i]) >= first then buckets[#buckets + 1] = flat[i + 1] end
  end
end
return {edge, buckets, call('HGETALL', STATUS)}
