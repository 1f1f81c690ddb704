-- rules.enqueue / rules.dequeue. ARGV[3..]: reservation id, enter (1: enqueue, 0: dequeue), configured (as
-- close.lua's; "" for a tenant no longer configured: the tenant-wide account, no limit).
-- -> {'not_found'} | {'unchanged', json} | {'quota', json, account key} | {'ok', json} | {'limits'}
local rid, enter = ARGV[3], ARGV[4] == '1'
local raw = call('HGET', RES, rid)
if not raw then return {'not_found'} end
local r = json_decode(raw)
local queued = r.queued == '1'
if r.status ~= 'open' or queued == enter then return {'unchanged', raw} end
local books = {{key = TENANT_ACCOUNT, lim = {}}}
if ARGV[5] ~= '' then books = books_of(r.model_class) end
if books == nil then return {'limits'} end
for _, b in ipairs(books) do
  b.acc = load_account(b.key)
  if enter and b.lim.max_queued ~= nil and b.acc.queued >= b.lim.max_queued then return {'quota', raw, b.key} end
end
for _, b in ipairs(books) do
  if enter then b.acc.queued = b.acc.queued + 1 else b.acc.queued = max(0, b.acc.queued - 1) end
  save_account(b.key, b.acc)
end
r.queued = enter and '1' or '0'
local out = json_encode(r)
hset(RES, rid, out)
touch_all()
return {'ok', out}
