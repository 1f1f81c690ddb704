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
local price = {price_input_micros = ARGV[13], price_output_micros = ARGV[14], price_gpu_micros = ARGV[15]}
local owner, lease = ARGV[16], tonumber(ARGV[17])
local books = books_of(model_class)
if books == nil then return {'limits'} end
local lim = books[#books].lim  -- the class's: run limits and the TTL

-- rules.check_retry + rules.reopens: an earlier reservation of the request id is returned (the caller
-- checks its arguments), unless it was cancelled with nothing billed and the arguments are the same.
local reopen = nil
local existing = redis.call('HGET', REQS, request_id)
if existing then
  local raw = redis.call('HGET', RES, existing)
  if raw then
    local old = cjson.decode(raw)
    local same = tonumber(old.input_tokens) == input_tokens and tonumber(old.max_output_tokens) == max_output
      and tonumber(old.gpu_ms_estimate) == estimate and old.model_class == model_class
      and (old.run_id or '') == (has_run and run_id or '') and (old.run_id ~= nil) == has_run
      and (old.tool_round == '1') == tool_round
    local unbilled = tonumber(old.billed_input_tokens) == 0 and tonumber(old.billed_output_tokens) == 0
      and tonumber(old.billed_gpu_ms) == 0
    if not (same and old.status == 'cancelled' and unbilled) then
      local balances = redis.call('HGET', ACCOUNTS, books[#books].key)
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
local function quota(dimension, retry, remaining, key)
  local r = ''
  if retry ~= nil then r = fmt(retry) end
  return {'quota', dimension, r, fmt(remaining), key}
end
local function wait_s(level, need, rate) return bucket_wait(level, need, rate, 60.0) end

-- rules._check_size_and_rates, on one account: a refusal, or nil.
local tokens = input_tokens + max_output
local function size_and_rates(acc, l, key)
  if l.max_tokens_per_request ~= nil and tokens > l.max_tokens_per_request then
    return quota('max_tokens_per_request', nil, 0, key)
  end
  if l.requests_per_minute ~= nil and reopen == nil and acc.requests_level < 1.0 then
    return quota('requests_per_minute', wait_s(acc.requests_level, 1.0, l.requests_per_minute), acc.requests_level, key)
  end
  for i = 2, 3 do  -- BUCKETS[2], [3]: input, output tokens
    local b = BUCKETS[i]
    local rate = l[b[1]]
    if rate ~= nil then
      local level, burst, need = acc[b[3]], l[b[2]] or 0.0, i == 2 and input_tokens or max_output
      if need > burst then return quota(b[1], nil, level, key) end
      if level < need then return quota(b[1], wait_s(level, need, rate), level, key) end
    end
  end
  return nil
end

-- rules._check_gpu, on one account: a refusal, or nil.
local function gpu(acc, l, key)
  if l.gpu_seconds ~= nil and acc.gpu_window_used_ms + estimate > l.gpu_seconds * 1000.0 then
    local window_end_ms = acc.gpu_window_start_ms + l.gpu_window_s * 1000.0
    local retry = nil
    if estimate <= l.gpu_seconds * 1000.0 then retry = math.max(0.0, (window_end_ms - now) / 1000.0) end
    return quota('gpu_seconds', retry, math.max(0.0, l.gpu_seconds - acc.gpu_window_used_ms / 1000.0), key)
  end
  if l.gpu_seconds_total ~= nil and acc.gpu_total_used_ms + estimate > l.gpu_seconds_total * 1000.0 then
    return quota('gpu_seconds_total', nil, math.max(0.0, l.gpu_seconds_total - acc.gpu_total_used_ms / 1000.0), key)
  end
  return nil
end

-- rules._check_spend, on one account: a refusal, or nil.
local spend = spend_of(tonumber(price.price_input_micros) or 0.0, tonumber(price.price_output_micros) or 0.0,
  tonumber(price.price_gpu_micros) or 0.0, input_tokens, max_output, estimate)
local function spend_budget(acc, l, key)
  -- 1e-3: rules.SPEND_SLACK_MICROS
  if l.spend_budget == nil or acc.spend_used_micros + spend <= l.spend_budget * 1e6 + 1e-3 then return nil end
  local retry = nil
  if spend <= l.spend_budget * 1e6 then
    retry = math.max(0.0, (next_period_start_ms(acc.spend_period_start_ms, l.spend_period) - now) / 1000.0)
  end
  return quota('spend_budget', retry, math.max(0.0, l.spend_budget - acc.spend_used_micros / 1e6), key)
end

local function concurrency(acc, l, key)
  if l.max_concurrent ~= nil and acc.concurrent >= l.max_concurrent then
    return quota('max_concurrent', 1.0, 0, key)
  end
end

-- rules.reserve, in its order of checks, each on every account in turn.
for _, check in ipairs({size_and_rates, concurrency, gpu, spend_budget}) do
  for _, b in ipairs(books) do
    local refused = check(b.acc, b.lim, b.key)
    if refused then return refused end
  end
end
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
    return quota('max_tokens', nil, math.max(0, lim.max_tokens - run.tokens), class_key)
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
  record.price_input_micros, record.price_output_micros = price.price_input_micros, price.price_output_micros
  record.price_gpu_micros = price.price_gpu_micros  -- rules.reopened: the class's price now
  count_status('cancelled', '-1')
  redis.call('HDEL', HB, rid)
  redis.call('HDEL', CLAIMS, rid)
else
  record = {id = rid, tenant = tenant, request_id = request_id, model_class = model_class,
    tool_round = tool_round and '1' or '0', input_tokens = fmt(input_tokens), max_output_tokens = fmt(max_output),
    gpu_ms_estimate = fmt(estimate), status = 'open', billed_input_tokens = '0', billed_output_tokens = '0',
    billed_gpu_ms = '0', overage_gpu_ms = '0', created_ms = fmt_time(now), expires_at_ms = expires_text,
    price_input_micros = price.price_input_micros, price_output_micros = price.price_output_micros,
    price_gpu_micros = price.price_gpu_micros}
  if has_run then record.run_id = run_id end
end
local raw = cjson.encode(record)
hset(RES, rid, raw)
remember_record(rid, raw, record)
hset(REQS, request_id, rid)
if redis.call('ZADD', OPEN, open_score(expires), rid) == 1 then keep(OPEN) end
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
