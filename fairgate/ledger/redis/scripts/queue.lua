-- rules.enqueue / rules.dequeue. ARGV[3..]: reservation id, enter (1: enqueue, 0: dequeue), max_queued or
-- "" (no limit). -> {'not_found'} | {'unchanged', json} | {'quota', json} | {'ok', json}
local rid, enter, max_queued = ARGV[3], ARGV[4] == '1', tonumber(ARGV[5])
local raw = redis.call('HGET', RES, rid)
if not raw then return {'not_found'} end
local r = cjson.decode(raw)
local queued = r.queued == '1'
if r.status ~= 'open' or queued == enter then return {'unchanged', raw} end
local acc = load_account(r.model_class)
if enter then
  if max_queued ~= nil and acc.queued >= max_queued then return {'quota', raw} end
  acc.queued = acc.queued + 1
  r.queued = '1'
else
  acc.queued = math.max(0, acc.queued - 1)
  r.queued = '0'
end
local out = cjson.encode(r)
hset(RES, rid, out)
save_account(r.model_class, acc)
touch_all()
return {'ok', out}
