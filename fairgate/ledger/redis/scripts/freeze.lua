-- ARGV[3..]: tenant, reason. -> {'ok'}
call('HSET', FROZEN, 'tenant', ARGV[3], 'reason', ARGV[4], 'at_ms', fmt(now_ms()))
keep(FROZEN)
touch_all()
return {'ok'}
