-- What every tenant script shares (loaded after bucket.lua, before the script's own body).
-- KEYS are the tenant's keys in keys.TENANT_KEYS order; ARGV[1] is now in ms ("" = the server's TIME),
-- ARGV[2] the retention TTL in ms; a script's own arguments start at ARGV[3].
if redis.replicate_commands then redis.replicate_commands() end  -- TIME before writes (Redis < 5)
local ACCOUNTS, RUNS, RES, REQS, OPEN, STATUS, EVENTS, SEQ, HB, FROZEN, CLAIMS, MINUTES =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10], KEYS[11], KEYS[12]
local RETENTION_MS = ARGV[2]
local MS_PER_MINUTE = 60000.0

local function fmt(x) return string.format('%.17g', x) end
local function num(s) if s == nil or s == false or s == '' then return nil end return tonumber(s) end

local function now_ms()
  if ARGV[1] ~= '' then return tonumber(ARGV[1]) end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000.0 + tonumber(t[2]) / 1000.0
end

-- Every write sets the TTL of the key it wrote, in the same breath; touch_all refreshes all of them.
local function expire(key) redis.call('PEXPIRE', key, RETENTION_MS) end
local function hset(key, field, value) redis.call('HSET', key, field, value); expire(key) end
local function touch_all() for i = 1, #KEYS do redis.call('PEXPIRE', KEYS[i], RETENTION_MS) end end

local ACCOUNT_FIELDS = {'requests_level', 'requests_updated_ms', 'input_level', 'input_updated_ms',
  'output_level', 'output_updated_ms', 'concurrent', 'gpu_window_start_ms', 'gpu_window_used_ms',
  'gpu_total_used_ms', 'queued'}

local function load_account(model_class)
  local acc = {requests_updated_ms = 0.0, input_updated_ms = 0.0, output_updated_ms = 0.0, concurrent = 0, queued = 0,
               gpu_window_start_ms = 0.0, gpu_window_used_ms = 0.0, gpu_total_used_ms = 0.0}
  local raw = redis.call('HGET', ACCOUNTS, model_class)
  if raw then
    local stored = cjson.decode(raw)
    for _, f in ipairs(ACCOUNT_FIELDS) do
      local v = num(stored[f])
      if v ~= nil then acc[f] = v end
    end
  end
  return acc
end

local function save_account(model_class, acc)
  local out = {}
  for _, f in ipairs(ACCOUNT_FIELDS) do
    if acc[f] ~= nil then out[f] = fmt(acc[f]) end
  end
  local raw = cjson.encode(out)
  hset(ACCOUNTS, model_class, raw)
  return raw
end

local function load_run(run_id)
  local run = {model_calls = 0, tool_rounds = 0, tokens = 0}
  local raw = redis.call('HGET', RUNS, run_id)
  if raw then
    local stored = cjson.decode(raw)
    run.model_calls, run.tool_rounds, run.tokens =
      tonumber(stored.model_calls), tonumber(stored.tool_rounds), tonumber(stored.tokens)
  end
  return run
end

local function save_run(run_id, run)
  hset(RUNS, run_id, cjson.encode({model_calls = fmt(run.model_calls), tool_rounds = fmt(run.tool_rounds),
                                   tokens = fmt(run.tokens)}))
end

-- Limits arrive as a JSON object of number strings (absent = no limit; *_burst is Limits.burst()).
local function decode_limits(spec)
  local lim = {}
  for k, v in pairs(spec) do lim[k] = tonumber(v) end
  return lim
end

-- TenantQuota.accounts: the accounts a reservation in model_class is charged to, each {key, lim}: the
-- tenant-wide one ('*', the tenant's limits), then the class's if the tenant's limits JSON
-- {"base": {...}, "classes": {model_class: {...}}} has a table for it. The last one's limits are the class's.
local TENANT_ACCOUNT = '*'
local function books_of(limits_json, model_class)
  local limits = cjson.decode(limits_json)
  local books = {{key = TENANT_ACCOUNT, lim = decode_limits(limits.base)}}
  if type(limits.classes) == 'table' and limits.classes[model_class] ~= nil then
    books[2] = {key = model_class, lim = decode_limits(limits.classes[model_class])}
  end
  return books
end

-- rules.refreshed: refill the buckets, roll the GPU window forward.
local BUCKETS = {{'requests', 'requests'}, {'input_tokens', 'input'}, {'output_tokens', 'output'}}
local function refresh(acc, lim, now)
  for _, b in ipairs(BUCKETS) do
    local rate = lim[b[1] .. '_per_minute']
    if rate ~= nil then
      local burst = lim[b[1] .. '_burst'] or 0.0
      local lk, uk = b[2] .. '_level', b[2] .. '_updated_ms'
      acc[lk], acc[uk] = bucket_refill(acc[lk], acc[uk], now, rate, burst, MS_PER_MINUTE)
    end
  end
  local window_ms = lim.gpu_window_s * 1000.0
  if now >= acc.gpu_window_start_ms + window_ms then
    acc.gpu_window_start_ms = now - math.fmod(now, window_ms)  -- Python's % for positive operands
    acc.gpu_window_used_ms = 0.0
  end
end

-- usage_minutes.py: an event's amounts are added to its minute's bucket in MINUTES, so usage() reads
-- buckets, not every event. minute_of: the exact floor (the division may round up to the next minute).
local MINUTE_MS = 60000
local function minute_of(at_ms)
  local m = math.floor(at_ms / MINUTE_MS)
  if m * MINUTE_MS > at_ms then m = m - 1 end
  return m
end

local function add_to_minute(at_ms, amounts)
  local field = fmt(minute_of(at_ms))
  local raw = redis.call('HGET', MINUTES, field)
  local sums = raw and cjson.decode(raw) or {'0', '0', '0', '0', '0'}
  for i = 1, 5 do sums[i] = fmt(tonumber(sums[i]) + amounts[i]) end  -- doubles, as a sum over events adds
  redis.call('HSET', MINUTES, field, cjson.encode(sums))
  local hi = num(redis.call('HGET', MINUTES, 'hi'))
  if hi == nil or minute_of(at_ms) > hi then redis.call('HSET', MINUTES, 'hi', field) end
  expire(MINUTES)
end

-- A tenant whose events predate the buckets gets them from its whole log, once, before its next event.
local function backfill_minutes()
  if redis.call('EXISTS', MINUTES) == 1 then return end
  for _, member in ipairs(redis.call('ZRANGE', EVENTS, 0, -1)) do
    local e = cjson.decode(member)
    add_to_minute(tonumber(e[9]), {tonumber(e[4]), tonumber(e[5]), tonumber(e[6]), tonumber(e[7]), tonumber(e[8])})
  end
end

local function add_event(rid, kind, requests, d_in, d_out, d_gpu, d_over, now)
  backfill_minutes()
  add_to_minute(now, {requests, d_in, d_out, d_gpu, d_over})
  local seq = redis.call('INCR', SEQ)
  expire(SEQ)
  local member = cjson.encode({fmt(seq), kind, rid, fmt(requests), fmt(d_in), fmt(d_out), fmt(d_gpu),
                               fmt(d_over), fmt(now)})
  redis.call('ZADD', EVENTS, fmt(now), member)
  expire(EVENTS)
end

local function count_status(status, by)
  redis.call('HINCRBY', STATUS, status, by)
  expire(STATUS)
end
