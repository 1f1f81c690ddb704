-- Read-only. ARGV[3]: window_s. -> {events in [now - window, +inf), flat status counts}
local since = now_ms() - tonumber(ARGV[3]) * 1000.0
return {redis.call('ZRANGEBYSCORE', EVENTS, fmt(since), '+inf'), redis.call('HGETALL', STATUS)}
