-- rules.reserve. ARGV[3..]: tenant, request_id, reservation id, input_tokens, max_output_tokens,
-- gpu_ms_estimate, model_class, run_id, has_run (1/0), tool_round (1/0), limits JSON.
-- -> {'existing', json} | {'ok', json} | {'quota', dimension, retry_after_s or '', remaining}
local tenant, request_id, rid = ARGV[3], ARGV[4], ARGV[5]
local input_tokens, max_output, estimate = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local model_class, run_id, has_run, tool_round = ARGV[9], ARGV[10], ARGV[11] == '1', ARGV[12] == '1'
local lim = decode_limits(cjson.decode(ARGV[13]))

local existing = redis.call('HGET', REQS, request_id)
if existing then
  local raw = redis.call('HGET', RES, existing)
  if raw then return {'existing', raw} end
end

local now = now_ms()
local acc = load_account(model_class)
refresh(acc, lim, now)
local function quota(dimension, retry, remaining)
  local r = ''
  if retry ~= nil then r = fmt(retry) end
  return {'quota', dimension, r, fmt(remaining)}
end
local function wait_s(level, need, rate) return bucket_wait(level, need, rate, 60.0) end

-- rules.reserve, in its order of checks.
local tokens = input_tokens + max_output
if lim.max_tokens_per_request ~= nil and tokens > lim.max_tokens_per_request then
  return quota('max_tokens_per_request', nil, 0)
end
if lim.requests_per_minute ~= nil and acc.requests_level < 1.0 then
  return quota('requests_per_minute', wait_s(acc.requests_level, 1.0, lim.requests_per_minute), acc.requests_level)
end
for _, d in ipairs({{'input_tokens', 'input', input_tokens}, {'output_tokens', 'output', max_output}}) do
  local rate = lim[d[1] .. '_per_minute']
  if rate ~= nil then
    local level, burst, need = acc[d[2] .. '_level'], lim[d[1] .. '_burst'] or 0.0, d[3]
    if need > burst then return quota(d[1] .. '_per_minute', nil, level) end
    if level < need then return quota(d[1] .. '_per_minute', wait_s(level, need, rate), level) end
  end
end
if lim.max_concurrent ~= nil and acc.concurrent >= lim.max_concurrent then
  return quota('max_concurrent', 1.0, 0)
end
if lim.gpu_seconds ~= nil and acc.gpu_window_used_ms + estimate > lim.gpu_seconds * 1000.0 then
  local window_end_ms = acc.gpu_window_start_ms + lim.gpu_window_s * 1000.0
  local retry = nil
  if estimate <= lim.gpu_seconds * 1000.0 then retry = math.max(0.0, (window_end_ms - now) / 1000.0) end
  return quota('gpu_seconds', retry, math.max(0.0, lim.gpu_seconds - acc.gpu_window_used_ms / 1000.0))
end
if lim.gpu_seconds_total ~= nil and acc.gpu_total_used_ms + estimate > lim.gpu_seconds_total * 1000.0 then
  return quota('gpu_seconds_total', nil, math.max(0.0, lim.gpu_seconds_total - acc.gpu_total_used_ms / 1000.0))
end
local run = nil
if has_run then
  run = load_run(run_id)
  if lim.max_model_calls ~= nil and run.model_calls + 1 > lim.max_model_calls then
    return quota('max_model_calls', nil, 0)
  end
  if tool_round and lim.max_tool_rounds ~= nil and run.tool_rounds + 1 > lim.max_tool_rounds then
    return quota('max_tool_rounds', nil, 0)
  end
  if lim.max_tokens ~= nil and run.tokens + tokens > lim.max_tokens then
    return quota('max_tokens', nil, math.max(0, lim.max_tokens - run.tokens))
  end
  run.model_calls = run.model_calls + 1
  if tool_round then run.tool_rounds = run.tool_rounds + 1 end
  run.tokens = run.tokens + tokens
end
if acc.requests_level ~= nil then acc.requests_level = acc.requests_level - 1.0 end
if acc.input_level ~= nil then acc.input_level = acc.input_level - input_tokens end
if acc.output_level ~= nil then acc.output_level = acc.output_level - max_output end
acc.concurrent = acc.concurrent + 1
acc.gpu_window_used_ms = acc.gpu_window_used_ms + estimate
acc.gpu_total_used_ms = acc.gpu_total_used_ms + estimate

-- All checks passed: write (nothing was written before this point).
local expires = now + lim.reservation_ttl_s * 1000.0
local record = {id = rid, tenant = tenant, request_id = request_id, model_class = model_class,
  tool_round = tool_round and '1' or '0', input_tokens = fmt(input_tokens), max_output_tokens = fmt(max_output),
  gpu_ms_estimate = fmt(estimate), status = 'open', billed_input_tokens = '0', billed_output_tokens = '0',
  billed_gpu_ms = '0', overage_gpu_ms = '0', created_ms = fmt(now), expires_at_ms = fmt(expires)}
if has_run then record.run_id = run_id end
local raw = cjson.encode(record)
hset(RES, rid, raw)
hset(REQS, request_id, rid)
redis.call('ZADD', OPEN, fmt(expires), rid)
expire(OPEN)
count_status('open', 1)
save_account(model_class, acc)
if run ~= nil then save_run(run_id, run) end
add_event(rid, 'reserve', 1, 0, 0, 0.0, 0.0, now)
touch_all()
return {'ok', raw}
