-- What every tenant script shares (loaded after bucket.lua, before the scripts' own bodies: lua.py runs them as
-- functions of one library, or each as an EVAL script). Every call starts with bind(KEYS, ARGV): KEYS are the
-- tenant's keys in keys.TENANT_KEYS order, then, for the scripts that apply limits (reserve, close, queue), the
-- tenant's limits hash (keys.Keys.limits); ARGV[1] is now in ms ("" = the server's TIME), ARGV[2] the retention
-- TTL in ms; a script's own arguments start at ARGV[3]. The names below are the library's, set afresh by each
-- call (a server runs one call at a time).
local KEYS, ARGV
local ACCOUNTS, RUNS, RES, REQS, OPEN, STATUS, EVENTS, SEQ, HB, FROZEN, CLAIMS, MINUTES, LIMITS, RETENTION_MS
local TENANT_KEY_COUNT = 12
local now_value, now_text  -- this call's now_ms() and its text (fmt_time)
local function bind(keys, argv)
  bind_globals()
  KEYS, ARGV, now_value, now_text = keys, argv, nil, nil
  ACCOUNTS, RUNS, RES, REQS, OPEN, STATUS, EVENTS, SEQ, HB, FROZEN, CLAIMS, MINUTES, LIMITS =
    keys[1], keys[2], keys[3], keys[4], keys[5], keys[6], keys[7], keys[8], keys[9], keys[10], keys[11], keys[12],
    keys[13]
  RETENTION_MS = tonumber(argv[2])
end
local MS_PER_MINUTE = 60000.0

-- A number as '%.17g' writes it (it reads back exactly); a whole number below 1e15 (counts, most amounts)
-- by the integer conversion, which writes the same digits for a fraction of the cost (-0 excepted).
local function fmt(x)
  if x % 1 == 0 and x > -1e15 and x < 1e15 then
    if x ~= 0 then return string.format('%d', x) end
    if 1 / x > 0 then return '0' end  -- the zero amounts of most events, without a format call
  end
  return string.format('%.17g', x)
end
-- fmt of a number that recurs from call to call (a count in flight, a GPU window's or spend period's start, a
-- minute), kept by the library: a table read is 150 instructions on this machine, string.format('%d') 2,100.
-- Not zero (fmt's own fast path, and -0 would read 0's text) nor NaN (no table key); up to STABLE_MAX, then
-- afresh.
local stable_texts, stable_count, STABLE_MAX = {}, 0, 1024
local function fmt_stable(x)
  local text = stable_texts[x]
  if text ~= nil then return text end
  text = fmt(x)
  if x == 0 or x ~= x then return text end
  if stable_count >= STABLE_MAX then stable_texts, stable_count = {}, 0 end
  stable_texts[x], stable_count = text, stable_count + 1
  return text
end
local function num(s) if s == nil or s == false or s == '' then return nil end return tonumber(s) end

local function now_ms()
  local now
  if ARGV[1] ~= '' then
    now = tonumber(ARGV[1])
  else
    local t = call('TIME')
    now = tonumber(t[1]) * 1000.0 + tonumber(t[2]) / 1000.0
  end
  if now ~= 0 then now_value = now end  -- 0 == -0, which fmt writes apart
  return now
end
-- fmt of a time, most often this call's now, formatted once: a reserve or a settlement writes now six times
-- (record, three bucket times, the event and its score), and '%.17g' costs 0.29 us a call on this machine.
local function fmt_time(x)
  if x ~= now_value then return fmt(x) end
  if now_text == nil then now_text = fmt(x) end
  return now_text
end

-- TTLs (keys.py): every key of the tenant carries the retention TTL, set afresh on all of them together
-- (touch_all, at the end of every script that writes) once ACCOUNTS' TTL has run down by REFRESH_AFTER_MS:
-- one PTTL per call rather than a PEXPIRE per key, and no key's TTL more than REFRESH_AFTER_MS below the
-- retention while the tenant is written. ACCOUNTS is created with the tenant's first reservation, as are the
-- keys that are never emptied (RES, REQS, STATUS, EVENTS, SEQ): those get their TTL from touch_all in that
-- call. A key a script may create later - one emptied meanwhile (OPEN, HB, CLAIMS, FROZEN) or first written
-- later (RUNS, MINUTES) - gets its TTL when a write may have created it (keep).
local REFRESH_AFTER_MS = 60000
local function keep(key) if call('PTTL', key) == -1 then call('PEXPIRE', key, RETENTION_MS) end end
local function hset(key, field, value) call('HSET', key, field, value) end
local function hset_kept(key, field, value)  -- a new field: the key may be new
  if call('HSET', key, field, value) == 1 then keep(key) end
end
local function touch_all()
  if call('PTTL', ACCOUNTS) > RETENTION_MS - REFRESH_AFTER_MS then return end
  for i = 1, TENANT_KEY_COUNT do call('PEXPIRE', KEYS[i], RETENTION_MS) end
end

-- An account as stored: JSON of its fields as number strings, an uninitialised bucket level absent. Each
-- table is built by one constructor, at its size (no rehash as fields are added).
local function decode_account(raw)
  local s = raw and json_decode(raw) or {}
  return {requests_level = num(s.requests_level), requests_updated_ms = num(s.requests_updated_ms) or 0.0,
          input_level = num(s.input_level), input_updated_ms = num(s.input_updated_ms) or 0.0,
          output_level = num(s.output_level), output_updated_ms = num(s.output_updated_ms) or 0.0,
          concurrent = num(s.concurrent) or 0, gpu_window_start_ms = num(s.gpu_window_start_ms) or 0.0,
          gpu_window_used_ms = num(s.gpu_window_used_ms) or 0.0, gpu_total_used_ms = num(s.gpu_total_used_ms) or 0.0,
          queued = num(s.queued) or 0, spend_period_start_ms = num(s.spend_period_start_ms) or 0.0,
          spend_used_micros = num(s.spend_used_micros) or 0.0}
end
-- Run as functions, the library keeps the last account it wrote per ACCOUNTS hash and account key, with its
-- JSON: one read back as written (same text, compared as one interned string) is handed out as kept, not
-- decoded (cjson and 13 tonumber calls, 2.9 us a read on this machine), nor copied (a table of 13 fields,
-- 5,000 instructions): the caller changes it, so the library forgets it until save_account keeps it again.
-- fmt's text reads back as the very number it wrote, so the table kept is what decoding gives. Up to SEEN_MAX
-- hashes (an account kept takes 1.2 KB of the functions' Lua memory), then afresh.
local seen_accounts, seen_count, SEEN_MAX = {}, 0, 1024
local function load_account(model_class)
  local raw = call('HGET', ACCOUNTS, model_class)
  local seen = seen_accounts[ACCOUNTS]
  local last = raw and seen and seen[model_class]
  if last then
    seen[model_class] = nil
    if last[1] == raw then return last[2] end
  end
  return decode_account(raw)
end

-- An account's JSON, written out rather than by cjson.encode (14,500 instructions against 8,400 on this
-- machine): every value is fmt's text of a number, which needs no escaping. An uninitialised level is absent.
local function level_json(name, x)
  if x == nil then return '' end
  return '"' .. name .. '":"' .. fmt(x) .. '",'
end
local function account_json(a)
  return '{' .. level_json('requests_level', a.requests_level) .. level_json('input_level', a.input_level)
    .. level_json('output_level', a.output_level)
    .. '"requests_updated_ms":"' .. fmt_time(a.requests_updated_ms)
    .. '","input_updated_ms":"' .. fmt_time(a.input_updated_ms)
    .. '","output_updated_ms":"' .. fmt_time(a.output_updated_ms)
    .. '","concurrent":"' .. fmt_stable(a.concurrent)
    .. '","gpu_window_start_ms":"' .. fmt_stable(a.gpu_window_start_ms)
    .. '","gpu_window_used_ms":"' .. fmt(a.gpu_window_used_ms) .. '","gpu_total_used_ms":"' .. fmt(a.gpu_total_used_ms)
    .. '","queued":"' .. fmt_stable(a.queued) .. '","spend_period_start_ms":"' .. fmt_stable(a.spend_period_start_ms)
    .. '","spend_used_micros":"' .. fmt(a.spend_used_micros) .. '"}'
end

-- Writes a; the script changes it no more (the library keeps it as the account's numbers).
local function save_account(model_class, a)
  local raw = account_json(a)
  hset(ACCOUNTS, model_class, raw)
  local seen = seen_accounts[ACCOUNTS]
  if seen == nil then
    if seen_count >= SEEN_MAX then seen_accounts, seen_count = {}, 0 end
    seen = {}
    seen_accounts[ACCOUNTS], seen_count = seen, seen_count + 1
  end
  seen[model_class] = {raw, a}
  return raw
end

local function load_run(run_id)
  local run = {model_calls = 0, tool_rounds = 0, tokens = 0}
  local raw = call('HGET', RUNS, run_id)
  if raw then
    local stored = json_decode(raw)
    run.model_calls, run.tool_rounds, run.tokens =
      tonumber(stored.model_calls), tonumber(stored.tool_rounds), tonumber(stored.tokens)
  end
  return run
end

local function save_run(run_id, run)
  hset_kept(RUNS, run_id, json_encode({model_calls = fmt(run.model_calls), tool_rounds = fmt(run.tool_rounds),
                                        tokens = fmt(run.tokens)}))
end

-- The tenant's limits, from its limits hash (LIMITS; codec.limits_hash writes it): per account key ('*': the
-- tenant's own limits; a model class with a table of its own) its limits packed as little-endian doubles in
-- codec.LIMIT_ORDER, the order unpack_limits names them in (NaN: no limit; *_burst is Limits.burst()): they
-- read back bit for bit, with no text to parse on every call.
local LIMITS_FORMAT = '<dddddddddddddddddd'
local function limit(x) if x ~= x then return nil end return x end  -- NaN: no limit
local PERIODS = {[1] = 'day', [2] = 'month'}  -- periods.PERIOD_CODES
local function unpack_limits(packed)
  local a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p, q, r = struct.unpack(LIMITS_FORMAT, packed)
  return {requests_per_minute = limit(a), input_tokens_per_minute = limit(b), output_tokens_per_minute = limit(c),
    requests_burst = limit(d), input_tokens_burst = limit(e), output_tokens_burst = limit(f),
    max_tokens_per_request = limit(g), max_concurrent = limit(h), max_queued = limit(i), gpu_seconds = limit(j),
    gpu_window_s = limit(k), gpu_seconds_total = limit(l), max_model_calls = limit(m), max_tool_rounds = limit(n),
    max_tokens = limit(o), reservation_ttl_s = limit(p), spend_budget = limit(q), spend_period = PERIODS[r]}
end

-- TenantQuota.accounts: the accounts a reservation in model_class is charged to, each {key, lim}: the
-- tenant-wide one ('*', the tenant's limits), then the class's if it has limits of its own. The last one's
-- limits are the class's. nil when the limits hash is not there (a server restarted or flushed, or the key
-- expired): the script then answers {'limits'} before writing anything, and the client writes the hash and
-- calls once more, so nothing ever runs without limits.
-- Run as functions, the library keeps the limits it unpacked, by their packed bytes (the same bytes, the same
-- limits; no script writes a limits table), up to UNPACKED_MAX of them.
local TENANT_ACCOUNT = '*'
local unpacked, unpacked_count, UNPACKED_MAX = {}, 0, 4096
local function limits_of(packed)
  local lim = unpacked[packed]
  if lim == nil then
    if unpacked_count >= UNPACKED_MAX then unpacked, unpacked_count = {}, 0 end
    lim = unpack_limits(packed)
    unpacked[packed], unpacked_count = lim, unpacked_count + 1
  end
  return lim
end
local function books_of(model_class)
  local got = call('HMGET', LIMITS, TENANT_ACCOUNT, model_class)
  if not got[1] then return nil end
  -- acc: the account, set by the caller (made a field here, so setting it does not grow the table).
  local books = {{key = TENANT_ACCOUNT, lim = limits_of(got[1]), acc = false}}
  if got[2] and model_class ~= TENANT_ACCOUNT then
    books[2] = {key = model_class, lim = limits_of(got[2]), acc = false}
  end
  return books
end

-- periods.py, line for line: days since the epoch <-> civil dates (Hinnant), and a spend period's start.
-- Every value is a whole number well below 2^53, so math.floor of a division is the integer division.
local DAY_MS = 86400000
local function idiv(a, b) return floor(a / b) end
local function days_from_civil(y, m, d)
  if m <= 2 then y = y - 1 end
  local era = idiv(y >= 0 and y or y - 399, 400)
  local yoe = y - era * 400
  local mm = m > 2 and m - 3 or m + 9
  local doy = idiv(153 * mm + 2, 5) + d - 1
  local doe = yoe * 365 + idiv(yoe, 4) - idiv(yoe, 100) + doy
  return era * 146097 + doe - 719468
end
local function civil_from_days(days)
  local z = days + 719468
  local era = idiv(z >= 0 and z or z - 146096, 146097)
  local doe = z - era * 146097
  local yoe = idiv(doe - idiv(doe, 1460) + idiv(doe, 36524) - idiv(doe, 146096), 365)
  local doy = doe - (365 * yoe + idiv(yoe, 4) - idiv(yoe, 100))
  local mp = idiv(5 * doy + 2, 153)
  local d = doy - idiv(153 * mp + 2, 5) + 1
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400
  if m <= 2 then y = y + 1 end
  return y, m, d
end
local function day_of(at_ms)  -- the exact floor of at_ms / DAY_MS (the division may round up)
  local days = floor(at_ms / DAY_MS)
  if days * DAY_MS > at_ms then days = days - 1 end
  return days
end
-- The month's start of the last day asked, kept: every refresh asks, and the calendar costs 0.6 us.
local month_of_day, month_start_ms = nil, nil
local function period_start_ms(now, period)
  local days = day_of(now)
  if period == 'day' then return days * DAY_MS end
  if days ~= month_of_day then
    local y, m = civil_from_days(days)
    month_of_day, month_start_ms = days, days_from_civil(y, m, 1) * DAY_MS
  end
  return month_start_ms
end
local function next_period_start_ms(start, period)
  local days = day_of(start)
  if period == 'day' then return (days + 1) * DAY_MS end
  local y, m = civil_from_days(days)
  if m == 12 then y, m = y + 1, 1 else m = m + 1 end
  return days_from_civil(y, m, 1) * DAY_MS
end

-- A reservation's stored price as numbers (micros per input token, per output token, per GPU-ms; 0 where
-- absent), read once per call: each tonumber costs 1,000 instructions on this machine and a settlement prices
-- four sets of amounts.
local function price_of(r)
  return tonumber(r.price_input_micros) or 0.0, tonumber(r.price_output_micros) or 0.0,
    tonumber(r.price_gpu_micros) or 0.0
end
-- Price.spend_micros, evaluated in the same order: what amounts cost at a price (price_of).
local function spend_of(p_in, p_out, p_gpu, input_tokens, output_tokens, gpu_ms)
  return input_tokens * p_in + output_tokens * p_out + gpu_ms * p_gpu
end

-- rules.refreshed: refill the buckets, roll the GPU window and the spend period forward.
-- Each bucket: its rate, burst, level and updated fields (no names built per call).
local BUCKETS = {{'requests_per_minute', 'requests_burst', 'requests_level', 'requests_updated_ms'},
  {'input_tokens_per_minute', 'input_tokens_burst', 'input_level', 'input_updated_ms'},
  {'output_tokens_per_minute', 'output_tokens_burst', 'output_level', 'output_updated_ms'}}
local function refresh(acc, lim, now)
  for i = 1, 3 do
    local b = BUCKETS[i]
    local rate = lim[b[1]]
    if rate ~= nil then
      local lk, uk = b[3], b[4]
      acc[lk], acc[uk] = bucket_refill(acc[lk], acc[uk], now, rate, lim[b[2]] or 0.0, MS_PER_MINUTE)
    end
  end
  local window_ms = lim.gpu_window_s * 1000.0
  if now >= acc.gpu_window_start_ms + window_ms then
    acc.gpu_window_start_ms = now - fmod(now, window_ms)  -- Python's % for positive operands
    acc.gpu_window_used_ms = 0.0
  end
  local start = period_start_ms(now, lim.spend_period or 'month')
  if start > acc.spend_period_start_ms then
    acc.spend_period_start_ms = start
    acc.spend_used_micros = 0.0
  end
end

-- usage_minutes.py: an event's amounts are added to its minute's bucket in MINUTES, so usage() reads
-- buckets, not every event. minute_of: the exact floor (the division may round up to the next minute).
local MINUTE_MS = 60000
local function minute_of(at_ms)
  local m = floor(at_ms / MINUTE_MS)
  if m * MINUTE_MS > at_ms then m = m - 1 end
  return m
end

-- Run as functions, the library keeps the minute bucket it wrote last per MINUTES hash, {field, its JSON, its
-- sums as texts, the sums as numbers (nil: not read yet)}: a bucket read back as written is taken as kept, not
-- decoded (cjson.decode, 6,900 instructions on this machine) nor its sums read again (tonumber, 1,000 to 2,700
-- each). A bucket taken has no JSON until written (an aborted call leaves none to match). Up to MINUTES_MAX
-- hashes, then afresh.
local kept_minutes, kept_minutes_count, MINUTES_MAX = {}, 0, 1024
local function minute_bucket(field, raw)
  local last = kept_minutes[MINUTES]
  if raw and last and last[1] == field and last[2] == raw then
    last[2] = nil
    return last
  end
  local texts = raw and json_decode(raw) or {'0', '0', '0', '0', '0', '0'}
  if texts[6] == nil then texts[6] = '0' end  -- a bucket written before spend was booked
  local bucket = {field, nil, texts, {}}
  if last == nil then
    if kept_minutes_count >= MINUTES_MAX then kept_minutes, kept_minutes_count = {}, 0 end
    kept_minutes_count = kept_minutes_count + 1
  end
  kept_minutes[MINUTES] = bucket
  return bucket
end

-- raw: the minute's bucket as read (false: none yet). A bucket written before means 'hi' is at least its
-- minute already; a new one may be the newest, and may create MINUTES.
local function add_to_minute(at_ms, amounts, raw)
  local minute = minute_of(at_ms)
  local field = fmt_stable(minute)
  local bucket = minute_bucket(field, raw)
  local texts, sums = bucket[3], bucket[4]
  for i = 1, 6 do  -- doubles, as a sum over events adds; adding 0 changes no sum (sums start at +0: none is -0)
    local amount = amounts[i]
    if amount ~= 0 then
      local sum = (sums[i] or tonumber(texts[i])) + amount
      sums[i], texts[i] = sum, fmt(sum)
    end
  end
  local json = json_encode(texts)
  if raw then
    call('HSET', MINUTES, field, json)
    bucket[2] = json
    return
  end
  local hi = num(call('HGET', MINUTES, 'hi'))
  if hi == nil or minute > hi then
    call('HSET', MINUTES, field, json, 'hi', field)
  else
    call('HSET', MINUTES, field, json)
  end
  bucket[2] = json
  keep(MINUTES)
end

-- An event's amounts (add_to_minute's) and its member's fields, filled in place by each event: no table built
-- an event (a table of six, 1,700 instructions on this machine).
local AMOUNTS = {0, 0, 0, 0, 0, 0}
local MEMBER = {'', '', '', '', '', '', '', '', '', ''}

-- A tenant whose events predate the buckets gets them from its whole log, once, before its next event.
local function backfill_minutes()
  for _, member in ipairs(call('ZRANGE', EVENTS, 0, -1)) do
    local e = json_decode(member)
    local at = tonumber(e[9])
    local amounts = AMOUNTS
    amounts[1], amounts[2], amounts[3], amounts[4], amounts[5], amounts[6] =
      tonumber(e[4]), tonumber(e[5]), tonumber(e[6]), tonumber(e[7]), tonumber(e[8]), tonumber(e[10] or '0')
    add_to_minute(at, amounts, call('HGET', MINUTES, fmt(minute_of(at))))
  end
end

local function add_event(rid, kind, requests, d_in, d_out, d_gpu, d_over, d_spend, now)
  local field = fmt_stable(minute_of(now))
  local raw = call('HGET', MINUTES, field)
  if not raw and call('EXISTS', MINUTES) == 0 then
    backfill_minutes()
    raw = call('HGET', MINUTES, field)
  end
  local amounts = AMOUNTS
  amounts[1], amounts[2], amounts[3], amounts[4], amounts[5], amounts[6] = requests, d_in, d_out, d_gpu, d_over, d_spend
  add_to_minute(now, amounts, raw)
  local seq = call('INCR', SEQ)
  local m = MEMBER
  m[1], m[2], m[3], m[4], m[5], m[6], m[7], m[8], m[9], m[10] = fmt(seq), kind, rid, fmt_stable(requests), fmt(d_in),
    fmt(d_out), fmt(d_gpu), fmt(d_over), fmt_time(now), fmt(d_spend)
  call('ZADD', EVENTS, fmt_time(now), json_encode(m))
end

-- Whether a stored reservation is open, without decoding it: cjson writes the field as '"status":"open"', and
-- no string value can hold that text unescaped (its quotes would be written \").
local function is_open(raw) return find(raw, '"status":"open"', 1, true) ~= nil end

-- rules.claim on open reservation rid at now: the run claim taken or renewed for owner for lease ms (with a
-- heartbeat), or its holder's unchanged -> holder, until_ms text, now text. free: no claim can be held on it (the
-- calling script made or re-opened it), so none is read. The caller ends with touch_all().
local function take_claim(rid, owner, lease, now, free)
  if not free then
    local held = call('HGET', CLAIMS, rid)
    if held then
      local sep = find(held, '\n', 1, true)
      local holder, until_ms = sub(held, 1, sep - 1), tonumber(sub(held, sep + 1))
      if holder ~= owner and until_ms > now then return holder, fmt(until_ms), fmt_time(now) end
    end
  end
  local until_text = fmt(now + lease)
  hset_kept(CLAIMS, rid, owner .. '\n' .. until_text)
  hset_kept(HB, rid, fmt_time(now))
  return owner, until_text, fmt_time(now)
end

-- rules._used_after, for close.lua: a reservation made (created) before the window or period began (start) is
-- charged only what it bills above its hold there, and gives back nothing it never took there.
local function used_after(created, used, start, change)
  if created < start then return used + max(0.0, change) end
  return max(0.0, used + change)
end
-- close.lua: the status a final settlement, cancellation or expiry leaves.
local FINAL_STATUS = {settle = 'settled', cancel = 'cancelled', expire = 'expired'}
-- by: '1' or '-1', as text: a number argument of redis.call is formatted by the server ('%.17g').
local function count_status(status, by) call('HINCRBY', STATUS, status, by) end
-- OPEN's score: expires_at_ms rounded up to a whole ms. A tenant's first 128 open reservations are a listpack,
-- which keeps a whole number as an integer but a fraction as text that every insert parses back (strtod) for
-- each entry it passes: 85k instructions an insert at 128 entries, against none. due.lua takes the exact time
-- from the record.
local function open_score(expires) return fmt(ceil(expires)) end

-- Run as functions, the library keeps the open reservations it wrote, per RES hash and id, with their JSON:
-- close.lua takes a record out rather than decode it when it reads that very text back (cjson.decode of a
-- reservation, 1.5 us on this machine). Every field of a record is a string, which cjson reads back unchanged.
-- A record taken is no longer kept (its script changes it); up to RECORDS_MAX kept (2.4 KB each of the
-- functions' Lua memory, used_memory_vm_functions), then afresh.
local kept_records, kept_count, RECORDS_MAX = {}, 0, 1024
local function remember_record(rid, raw, r)
  if kept_count >= RECORDS_MAX then kept_records, kept_count = {}, 0 end
  local kept = kept_records[RES]
  if kept == nil then
    kept = {}
    kept_records[RES] = kept
  end
  if kept[rid] == nil then kept_count = kept_count + 1 end
  kept[rid] = {raw, r}
end
local function recall_record(rid, raw)
  local kept = kept_records[RES]
  local last = kept and kept[rid]
  if last == nil then return json_decode(raw) end
  kept[rid], kept_count = nil, kept_count - 1
  if last[1] == raw then return last[2] end
  return json_decode(raw)
end

-- reserve.lua's checks (rules.reserve), defined once by the library rather than as closures by every call:
-- each refusal is {'quota', dimension, retry_after_s or '', remaining, account key}. The request's amounts
-- are the library's, set by reserve_refusal for the call (a server runs one call at a time).
local function quota(dimension, retry, remaining, key)
  local r = ''
  if retry ~= nil then r = fmt(retry) end
  return {'quota', dimension, r, fmt(remaining), key}
end
local function wait_s(level, need, rate) return bucket_wait(level, need, rate, 60.0) end
local req_input, req_output, req_estimate, req_spend, req_now, req_reopened

-- rules._check_size_and_rates, on one account: a refusal, or nil.
local function size_and_rates(acc, l, key)
  if l.max_tokens_per_request ~= nil and req_input + req_output > l.max_tokens_per_request then
    return quota('max_tokens_per_request', nil, 0, key)
  end
  if l.requests_per_minute ~= nil and not req_reopened and acc.requests_level < 1.0 then
    return quota('requests_per_minute', wait_s(acc.requests_level, 1.0, l.requests_per_minute), acc.requests_level, key)
  end
  for i = 2, 3 do  -- BUCKETS[2], [3]: input, output tokens
    local b = BUCKETS[i]
    local rate = l[b[1]]
    if rate ~= nil then
      local level, burst, need = acc[b[3]], l[b[2]] or 0.0, i == 2 and req_input or req_output
      if need > burst then return quota(b[1], nil, level, key) end
      if level < need then return quota(b[1], wait_s(level, need, rate), level, key) end
    end
  end
  return nil
end

-- rules._check_gpu, on one account: a refusal, or nil.
local function gpu(acc, l, key)
  local estimate = req_estimate
  if l.gpu_seconds ~= nil and acc.gpu_window_used_ms + estimate > l.gpu_seconds * 1000.0 then
    local window_end_ms = acc.gpu_window_start_ms + l.gpu_window_s * 1000.0
    local retry = nil
    if estimate <= l.gpu_seconds * 1000.0 then retry = max(0.0, (window_end_ms - req_now) / 1000.0) end
    return quota('gpu_seconds', retry, max(0.0, l.gpu_seconds - acc.gpu_window_used_ms / 1000.0), key)
  end
  if l.gpu_seconds_total ~= nil and acc.gpu_total_used_ms + estimate > l.gpu_seconds_total * 1000.0 then
    return quota('gpu_seconds_total', nil, max(0.0, l.gpu_seconds_total - acc.gpu_total_used_ms / 1000.0), key)
  end
  return nil
end

-- rules._check_spend, on one account: a refusal, or nil.
local function spend_budget(acc, l, key)
  local spend = req_spend
  -- 1e-3: rules.SPEND_SLACK_MICROS
  if l.spend_budget == nil or acc.spend_used_micros + spend <= l.spend_budget * 1e6 + 1e-3 then return nil end
  local retry = nil
  if spend <= l.spend_budget * 1e6 then
    retry = max(0.0, (next_period_start_ms(acc.spend_period_start_ms, l.spend_period) - req_now) / 1000.0)
  end
  return quota('spend_budget', retry, max(0.0, l.spend_budget - acc.spend_used_micros / 1e6), key)
end

local function concurrency(acc, l, key)
  if l.max_concurrent ~= nil and acc.concurrent >= l.max_concurrent then
    return quota('max_concurrent', 1.0, 0, key)
  end
end

-- rules.reserve, in its order of checks, each on every account in turn (books' accounts refreshed at now): a
-- refusal, or nil. reopened: a cancelled reservation re-opened (no request counted).
local RESERVE_CHECKS = {size_and_rates, concurrency, gpu, spend_budget}
local function reserve_refusal(books, input_tokens, max_output, estimate, spend, now, reopened)
  req_input, req_output, req_estimate, req_spend, req_now, req_reopened =
    input_tokens, max_output, estimate, spend, now, reopened
  for c = 1, #RESERVE_CHECKS do
    local check = RESERVE_CHECKS[c]
    for i = 1, #books do
      local b = books[i]
      local refused = check(b.acc, b.lim, b.key)
      if refused then return refused end
    end
  end
  return nil
end
