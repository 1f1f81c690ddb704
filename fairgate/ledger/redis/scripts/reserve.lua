-- rules.reserve, then (claim owner given) rules.claim_on_reserve. ARGV[3..]: tenant, request_id, reservation id,
-- input_tokens, max_output_tokens, gpu_ms_estimate, model_class, run_id, has_run (1/0), tool_round (1/0), the
-- class's price (micros per input token, per output token, per GPU-ms: model.Price), the run claim's owner ('':
-- none asked) and lease ms. KEYS[13]: the tenant's limits hash.
-- -> {'existing', json, binding account json or false[, holder, until_ms, now]}
--    | {'ok', json, binding account json[, holder, until_ms, now]}
--    | {'quota', dimension, retry_after_s or '', remaining, account key} | {'limits'} (no limits hash)
-- The binding account (the last book's) is what account() reads right after: the caller's balances. The claim
-- (holder, until_ms, now) comes when an owner is given and the reservation is open - on 'existing' only with the
-- same arguments (else the caller raises IdempotencyConflict, and nothing is written).
local tenant, request_id, rid = ARGV[3], ARGV[4], ARGV[5]
local input_tokens, max_output, estimate = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local model_class, run_id, has_run, tool_round = ARGV[9], ARGV[10], ARGV[11] == '1', ARGV[12] == '1'
local price_input, price_output, price_gpu = ARGV[13], ARGV[14], ARGV[15]
local owner, lease = ARGV[16], tonumber(ARGV[17])
local books = books_of(model_class)
if books == nil then return {'limits'} end
local lim = books[#books].lim  -- the class's: run limits and the TTL

-- rules.check_retry + rules.reopens: an earlier reservation of the request id is returned (the caller
-- checks its arguments), unless it was cancelled with nothing billed and the arguments are the same.
local reopen = nil
local existing = call('HGET', REQS, request_id)
if existing then
  local raw = call('HGET', RES, existing)
  if raw then
    local old = json_decode(raw)
    local same = tonumber(old.input_tokens) == input_tokens and tonumber(old.max_output_tokens) == max_output
      and tonumber(old.gpu_ms_estimate) == estimate and old.model_class == model_class
      and (old.run_id or '') == (has_run and run_id or '') and (old.run_id ~= nil) == has_run
      and (old.tool_round == '1') == tool_round
    local unbilled = tonumber(old.billed_input_tokens) == 0 and tonumber(old.billed_output_tokens) == 0
      and tonumber(old.billed_gpu_ms) == 0
    if not (same and old.status == 'cancelled' and unbilled) then
      local balances = call('HGET', ACCOUNTS, books[#books].key)
      if owner == '' or not same or old.status ~= 'open' then return {'existing', raw, balances} end
      local holder, until_text, now_text = take_claim(existing, owner, lease, now_ms(), false)
      if holder == owner then touch_all() end
      return {'existing', raw, balances, holder, until_text, now_text}
    end
    reopen = old
  end
end

local now = now_ms()
for _, b in ipairs(books) do
  b.acc = load_account(b.key)
  refresh(b.acc, b.lim, now)
end
local spend = spend_of(tonumber(price_input) or 0.0, tonumber(price_output) or 0.0, tonumber(price_gpu) or 0.0,
  input_tokens, max_output, estimate)
local refused = reserve_refusal(books, input_tokens, max_output, estimate, spend, now, reopen ~= nil)
if refused then return refused end
local tokens = input_tokens + max_output
local class_key = books[#books].key
local run = nil
if has_run then
  run = load_run(run_id)
  if reopen == nil and lim.max_model_calls ~= nil and run.model_calls + 1 > lim.max_model_calls then
    return quota('max_model_calls', nil, 0, class_key)
  end
  if reopen == nil and tool_round and lim.max_tool_rounds ~= nil and run.tool_rounds + 1 > lim.max_tool_rounds then
    return quota('max_tool_rounds', nil, 0, class_key)
  end
  if lim.max_tokens ~= nil and run.tokens + tokens > lim.max_tokens then
    return quota('max_tokens', nil, max(0, lim.max_tokens - run.tokens), class_key)
  end
  if reopen == nil then  -- rules.reserve(again): a re-open was counted as a call when first reserved
    run.model_calls = run.model_calls + 1
    if tool_round then run.tool_rounds = run.tool_rounds + 1 end
  end
  run.tokens = run.tokens + tokens
end
for _, b in ipairs(books) do
  local acc = b.acc
  if acc.requests_level ~= nil and reopen == nil then acc.requests_level = acc.requests_level - 1.0 end
  if acc.input_level ~= nil then acc.input_level = acc.input_level - input_tokens end
  if acc.output_level ~= nil then acc.output_level = acc.output_level - max_output end
  acc.concurrent = acc.concurrent + 1
  acc.gpu_window_used_ms = acc.gpu_window_used_ms + estimate
  acc.gpu_total_used_ms = acc.gpu_total_used_ms + estimate
  acc.spend_used_micros = acc.spend_used_micros + spend
end

-- All checks passed: write (nothing was written before this point).
local expires = now + lim.reservation_ttl_s * 1000.0
local expires_text = fmt(expires)
local record
if reopen ~= nil then  -- rules.reopened: same id and creation time, nothing billed, a new TTL
  record = reopen
  rid = record.id
  record.status, record.billed_input_tokens, record.billed_output_tokens, record.billed_gpu_ms = 'open', '0', '0', '0'
  record.overage_gpu_ms, record.expires_at_ms, record.final_ms, record.queued = '0', expires_text, nil, '0'
  record.price_input_micros, record.price_output_micros = price_input, price_output
  record.price_gpu_micros = price_gpu  -- rules.reopened: the class's price now
  count_status('cancelled', '-1')
  call('HDEL', HB, rid)
  call('HDEL', CLAIMS, rid)
else
  record = {id = rid, tenant = tenant, request_id = request_id, model_class = model_class,
    tool_round = tool_round and '1' or '0', input_tokens = fmt(input_tokens), max_output_tokens = fmt(max_output),
    gpu_ms_estimate = fmt(estimate), status = 'open', billed_input_tokens = '0', billed_output_tokens = '0',
    billed_gpu_ms = '0', overage_gpu_ms = '0', created_ms = fmt_time(now), expires_at_ms = expires_text,
    price_input_micros = price_input, price_output_micros = price_output, price_gpu_micros = price_gpu}
  if has_run then record.run_id = run_id end
end
local raw = json_encode(record)
hset(RES, rid, raw)
remember_record(rid, raw, record)
hset(REQS, request_id, rid)
if call('ZADD', OPEN, open_score(expires), rid) == 1 then keep(OPEN) end
count_status('open', '1')
local balances
for _, b in ipairs(books) do balances = save_account(b.key, b.acc) end
if run ~= nil then save_run(run_id, run) end
add_event(rid, 'reserve', reopen == nil and 1 or 0, 0, 0, 0.0, 0.0, 0.0, now)
if owner ~= '' then  -- nobody holds a claim on a reservation this call made or re-opened
  local holder, until_text, now_text = take_claim(rid, owner, lease, now, true)
  touch_all()
  return {'ok', raw, balances, holder, until_text, now_text}
end
touch_all()
return {'ok', raw, balances}
