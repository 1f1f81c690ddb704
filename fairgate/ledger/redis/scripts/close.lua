-- rules.settle (settle, cancel, expire). ARGV[3..]: reservation id, kind (settle|cancel|expire), final (1/0),
-- input_tokens, output_tokens, gpu_ms (ignored for expire: the billed amounts so far), configured (1: the
-- tenant has limits, in the hash KEYS[13]; "": it is no longer configured).
-- -> {'not_found'} | {'final', json} | {'frozen', json} | {'unknown_tenant', json} | {'not_due', json}
--    | {'unchanged', json} | {'above', json} | {'below', name, json} | {'ok', json}
--    | {'limits'} (no limits hash)
local rid, kind, final = ARGV[3], ARGV[4], ARGV[5] == '1'
local raw = call('HGET', RES, rid)
if not raw then return {'not_found'} end
local r = recall_record(rid, raw)
if r.status ~= 'open' then return {'final', raw} end
if call('EXISTS', FROZEN) == 1 then return {'frozen', raw} end
local now = now_ms()
local before_in, before_out, before_gpu =
  tonumber(r.billed_input_tokens), tonumber(r.billed_output_tokens), tonumber(r.billed_gpu_ms)
local b_in, b_out, b_gpu
if kind == 'expire' then
  if tonumber(r.expires_at_ms) > now then return {'not_due', raw} end
  b_in, b_out, b_gpu = before_in, before_out, before_gpu
else
  b_in, b_out, b_gpu = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
end
if (not final) and b_in == before_in and b_out == before_out and b_gpu == before_gpu then
  return {'unchanged', raw}  -- a repeated partial settlement: nothing new
end
local books
if ARGV[9] == '' then
  -- A tenant no longer configured: refused, but for the sweep's expiry, which must not stop at it (its
  -- tenant-wide account, no limit, the default GPU window: Ledger.closing_books).
  if kind ~= 'expire' then return {'unknown_tenant', raw} end
  books = {{key = TENANT_ACCOUNT, lim = {gpu_window_s = 86400.0, spend_period = 'month'}}}
else
  books = books_of(r.model_class)  -- every account the reservation was charged to
end
if books == nil then return {'limits'} end

-- rules.settle
local r_in, r_max_out, r_est = tonumber(r.input_tokens), tonumber(r.max_output_tokens), tonumber(r.gpu_ms_estimate)
if b_out > r_max_out then return {'above', raw} end
if b_in < before_in then return {'below', 'input_tokens', raw} end
if b_out < before_out then return {'below', 'output_tokens', raw} end
if b_gpu < before_gpu then return {'below', 'gpu_ms', raw} end
local old_in, old_out, old_gpu = max(r_in, before_in), r_max_out, max(r_est, before_gpu)
local new_in, new_out, new_gpu
if final then
  new_in, new_out, new_gpu = b_in, b_out, b_gpu
else
  new_in, new_out, new_gpu = max(r_in, b_in), r_max_out, max(r_est, b_gpu)
end
local p_in, p_out, p_gpu = price_of(r)
local spend_change = spend_of(p_in, p_out, p_gpu, new_in, new_out, new_gpu)
  - spend_of(p_in, p_out, p_gpu, old_in, old_out, old_gpu)
local created = tonumber(r.created_ms)
local credit_in, credit_out = old_in - new_in, old_out - new_out  -- what goes back to the token buckets
for _, b in ipairs(books) do
  local acc, lim = load_account(b.key), b.lim
  refresh(acc, lim, now)
  if acc.input_level ~= nil and credit_in ~= 0 then
    acc.input_level = bucket_credit(acc.input_level, credit_in, lim.input_tokens_burst or 0.0)
  end
  if acc.output_level ~= nil and credit_out ~= 0 then
    acc.output_level = bucket_credit(acc.output_level, credit_out, lim.output_tokens_burst or 0.0)
  end
  acc.gpu_window_used_ms = used_after(created, acc.gpu_window_used_ms, acc.gpu_window_start_ms, new_gpu - old_gpu)
  acc.gpu_total_used_ms = max(0.0, acc.gpu_total_used_ms + new_gpu - old_gpu)
  acc.spend_used_micros = used_after(created, acc.spend_used_micros, acc.spend_period_start_ms, spend_change)
  if final then
    acc.concurrent = max(0, acc.concurrent - 1)
    if r.queued == '1' then acc.queued = max(0, acc.queued - 1) end
  end
  b.acc = acc
end
if final then r.queued = '0' end
local run = nil
if r.run_id ~= nil then
  run = load_run(r.run_id)
  run.tokens = max(0, run.tokens + (new_in + new_out) - (old_in + old_out))
end
local overage = max(0.0, b_gpu - r_est)
local old_overage = tonumber(r.overage_gpu_ms)
local status, event_kind = 'open', 'settle'
if final then
  status = FINAL_STATUS[kind]
  event_kind = kind
  if kind == 'settle' then event_kind = 'settle_final' end
end
r.billed_input_tokens, r.billed_output_tokens, r.billed_gpu_ms = fmt(b_in), fmt(b_out), fmt(b_gpu)
r.overage_gpu_ms, r.status = fmt(overage), status
if final then r.final_ms = fmt_time(now) end

local out = json_encode(r)
hset(RES, rid, out)
if not final then remember_record(rid, out, r) end
for _, b in ipairs(books) do save_account(b.key, b.acc) end
if run ~= nil then save_run(r.run_id, run) end
local d_spend = spend_of(p_in, p_out, p_gpu, b_in, b_out, b_gpu)
  - spend_of(p_in, p_out, p_gpu, before_in, before_out, before_gpu)
add_event(rid, event_kind, 0, b_in - before_in, b_out - before_out, b_gpu - before_gpu, overage - old_overage,
          d_spend, now)
if final then
  call('ZREM', OPEN, rid)
  count_status('open', '-1')
  count_status(status, '1')
  call('HDEL', HB, rid)
  call('HDEL', CLAIMS, rid)
end
touch_all()
return {'ok', out}
