-- Read-only. ARGV[3]: reservation id. -> {last heartbeat ms or '', now}
local beat = call('HGET', HB, ARGV[3])
return {beat or '', fmt(now_ms())}
