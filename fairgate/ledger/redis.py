"""The ledger on Redis (redis-py asyncio): the rules of ``rules.py`` as Lua scripts, one EVALSHA per call.

Every mutating call (reserve, settle, cancel, expiry, extension, heartbeat, freeze) is a single Lua
script, so it reads and writes a tenant's balances atomically: concurrent callers in any number of
processes never both read the same balance. The scripts implement the arithmetic and the check order
of ``rules.reserve`` / ``rules.settle`` / ``rules.refreshed`` line by line (Lua numbers are IEEE doubles
like Python floats; every number is stored as a ``%.17g`` string so it round-trips exactly). The clock
is the server's ``TIME`` read inside the script, so gateway processes with different clocks agree;
a ``clock`` passed to ``open`` (tests) is sent as an argument instead.

URL: ``redis://[[user]:password@]host[:6379][/db]?prefix=NAME`` (``rediss://`` for TLS). The path is the
database number (default 0). ``prefix`` (default ``fairgate``) must match ``[A-Za-z0-9_.-]{1,64}``;
``retention_days`` (default 35, in [1, 3650]) sets the key TTL below; ``timeout_s`` (default 2, in (0, 600])
bounds connecting and every reply: a server that does not answer raises ``LedgerUnavailable`` after about
that long (a connection the server closed is retried once; a timeout is not). With ``rediss://`` only,
``ssl_cert_reqs`` (none | optional | required), ``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile`` and
``ssl_check_hostname`` (true | false) configure TLS. Any other, or a repeated, query parameter is a
``ValueError``. Every redis-py error (connection, timeout, protocol, server error reply) surfaces as a
one-line ``LedgerUnavailable``; a database number the server does not have is a ``ValueError`` at ``open``.

Key layout (``P`` = prefix, ``T`` = ``tenant_tag(tenant)``, 16 hex digits). Every key of a tenant
contains the hash tag ``{P:T}``, so all of them live in one cluster hash slot and one script can touch
them all; a reservation id starts with ``T``, so the slot is known from the id alone.

==========================  ======  =====================================================================
key                         type    content
==========================  ======  =====================================================================
``{P:T}:accounts``          hash    model class -> JSON of ``rules.Account`` (numbers as strings;
                                    an uninitialised bucket level is absent)
``{P:T}:runs``              hash    run id -> JSON ``{model_calls, tool_rounds, tokens}``
``{P:T}:res``               hash    reservation id -> JSON of the reservation (numbers as strings)
``{P:T}:reqs``              hash    request id -> reservation id (idempotency index)
``{P:T}:open``              zset    open reservation ids, scored by ``expires_at_ms`` (the sweeper)
``{P:T}:status``            hash    status -> number of reservations (``usage().by_status``)
``{P:T}:events``            zset    the event log: JSON ``[seq, kind, id, requests, input, output,
                                    gpu_ms, overage_gpu_ms, at_ms]`` scored by ``at_ms``
``{P:T}:seq``               string  the tenant's event sequence (INCR)
``{P:T}:hb``                hash    reservation id -> last heartbeat ms (open reservations only)
``{P:T}:frozen``            hash    ``tenant``, ``reason``, ``at_ms`` while settlement is frozen
``P:tenants``               hash    tenant tag -> tenant name: the registry ``events()``,
                                    ``reservations()``, ``expire_due()`` and ``frozen()`` iterate over
                                    (the one key outside a tenant's slot; written by its own script)
==========================  ======  =====================================================================

TTL: every key carries a retention TTL (default 35 days). Each write sets the TTL of the key written in
the same script call, and every tenant script that writes refreshes the TTL of all ten of the tenant's
keys, so a tenant's state lives as a whole while it is written at least once per retention period and
then expires as a whole (an idle tenant's history, freeze and open reservations included). The
registry's TTL is refreshed whenever a process registers a tenant (at most every
``REGISTER_EVERY_S`` per tenant and process, on reserve and freeze). As with the SQL backends, an
active tenant's event log and reservation hash are never trimmed.

Differences from the SQL backends: ``Event.seq`` is a per-tenant sequence (not ledger-wide), and
``events()`` over all tenants merges the tenants' logs by ``at_ms`` (each tenant's own order kept);
the expiry script closes a reservation only if it is still due and its tenant not frozen (a reservation
extended or frozen by someone else meanwhile is skipped rather than raising).
"""

from __future__ import annotations

import heapq
import json
import math
import os
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import redis.exceptions
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.connection import Connection, SSLConnection
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from fairgate.ledger import rules
from fairgate.ledger.backend import Backend
from fairgate.ledger.base import ChargeTotals, Event, Ledger, new_reservation_id, tenant_tag
from fairgate.ledger.checks import check_filters, check_reservation_id, check_window
from fairgate.ledger.config import Limits, Quotas
from fairgate.ledger.model import (
    InvalidUsage,
    LedgerUnavailable,
    QuotaExceeded,
    Reservation,
    ReservationNotFound,
    SettlementFrozen,
    TenantUsage,
    UnknownTenant,
    Usage,
    check_name,
    usage_from_events,
)
from fairgate.ledger.text import one_line as _one_line
from fairgate.ledger.text import redacted as _redacted

DEFAULT_PREFIX = "fairgate"
DEFAULT_RETENTION_DAYS = 35.0
DEFAULT_TIMEOUT_S = 2.0
POOL_WAIT_S = 10.0  # how long a call waits for a free pooled connection
_PARAMS = ("prefix", "retention_days", "timeout_s")
_TLS_PARAMS = ("ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_check_hostname")
_TLS_FILES = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")
_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
REGISTER_EVERY_S = 600.0  # how often a process re-registers a tenant (refreshing the registry's TTL)
_PREFIX = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_RESERVATION_ID = re.compile(r"^([0-9a-f]{16})-")
# The tenant keys, in the order of the scripts' KEYS (see the table in the module docstring).
TENANT_KEYS = ("accounts", "runs", "res", "reqs", "open", "status", "events", "seq", "hb", "frozen")
_STATUS_OF_KIND = {"settle": "settled", "cancel": "cancelled", "expire": "expired"}
_LIMIT_NAMES = (
    "requests_per_minute",
    "input_tokens_per_minute",
    "output_tokens_per_minute",
    "max_tokens_per_request",
    "max_concurrent",
    "max_queued",
    "gpu_seconds",
    "gpu_window_s",
    "gpu_seconds_total",
    "max_model_calls",
    "max_tool_rounds",
    "max_tokens",
    "reservation_ttl_s",
)
_INT_REMAINING = {
    "max_tokens_per_request",
    "max_concurrent",
    "max_queued",
    "max_model_calls",
    "max_tool_rounds",
    "max_tokens",
}

# --- Lua -----------------------------------------------------------------------------------------
# ARGV[1] is now in ms ("" = the server's TIME), ARGV[2] the retention TTL in ms; KEYS are TENANT_KEYS.
_PRELUDE = r"""
if redis.replicate_commands then redis.replicate_commands() end  -- TIME before writes (Redis < 5)
local ACCOUNTS, RUNS, RES, REQS, OPEN, STATUS, EVENTS, SEQ, HB, FROZEN =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10]
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
  hset(ACCOUNTS, model_class, cjson.encode(out))
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

-- rules.refreshed: refill the buckets, roll the GPU window forward.
local BUCKETS = {{'requests', 'requests'}, {'input_tokens', 'input'}, {'output_tokens', 'output'}}
local function refresh(acc, lim, now)
  for _, b in ipairs(BUCKETS) do
    local rate = lim[b[1] .. '_per_minute']
    if rate ~= nil then
      local burst = lim[b[1] .. '_burst'] or 0.0
      local lk, uk = b[2] .. '_level', b[2] .. '_updated_ms'
      if acc[lk] == nil then
        acc[lk], acc[uk] = burst, now
      else
        local elapsed = math.max(0.0, now - acc[uk])
        acc[lk] = math.min(burst, acc[lk] + elapsed * rate / MS_PER_MINUTE)
        acc[uk] = math.max(acc[uk], now)
      end
    end
  end
  local window_ms = lim.gpu_window_s * 1000.0
  if now >= acc.gpu_window_start_ms + window_ms then
    acc.gpu_window_start_ms = now - math.fmod(now, window_ms)  -- Python's % for positive operands
    acc.gpu_window_used_ms = 0.0
  end
end

local function add_event(rid, kind, requests, d_in, d_out, d_gpu, d_over, now)
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
"""

# ARGV[3..]: tenant, request_id, reservation id, input_tokens, max_output_tokens, gpu_ms_estimate,
# model_class, run_id, has_run (1/0), tool_round (1/0), limits JSON.
# -> {'existing', json} | {'ok', json} | {'quota', dimension, retry_after_s or '', remaining}
_RESERVE = (
    _PRELUDE
    + r"""
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
local function wait_s(level, need, rate) return math.max(0.0, (need - level) / rate * 60.0) end

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
"""
)

# ARGV[3..]: reservation id, kind (settle|cancel|expire), final (1/0), input_tokens, output_tokens, gpu_ms
# (ignored for expire: the billed amounts so far), check frozen (1/0), the tenant's limits JSON
# {"base": {...}, "classes": {model_class: {...}}} or "" (tenant not configured).
# -> {'not_found'} | {'final', json} | {'frozen', json} | {'unknown_tenant', json} | {'not_due', json}
#    | {'unchanged', json} | {'above', json} | {'below', name, json} | {'ok', json}
_CLOSE = (
    _PRELUDE
    + r"""
local rid, kind, final = ARGV[3], ARGV[4], ARGV[5] == '1'
local raw = redis.call('HGET', RES, rid)
if not raw then return {'not_found'} end
local r = cjson.decode(raw)
if r.status ~= 'open' then return {'final', raw} end
if ARGV[9] == '1' and redis.call('EXISTS', FROZEN) == 1 then return {'frozen', raw} end
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
if ARGV[10] == '' then return {'unknown_tenant', raw} end
local limits = cjson.decode(ARGV[10])
local spec = limits.base
if type(limits.classes) == 'table' and limits.classes[r.model_class] ~= nil then spec = limits.classes[r.model_class] end
local lim = decode_limits(spec)

-- rules.settle
local r_in, r_max_out, r_est = tonumber(r.input_tokens), tonumber(r.max_output_tokens), tonumber(r.gpu_ms_estimate)
if b_out > r_max_out then return {'above', raw} end
if b_in > 2 * r_in + 1024 then return {'above_input', raw} end  -- rules.input_allowance
if b_in < before_in then return {'below', 'input_tokens', raw} end
if b_out < before_out then return {'below', 'output_tokens', raw} end
if b_gpu < before_gpu then return {'below', 'gpu_ms', raw} end
local acc = load_account(r.model_class)
refresh(acc, lim, now)
local old_in, old_out, old_gpu = math.max(r_in, before_in), r_max_out, math.max(r_est, before_gpu)
local new_in, new_out, new_gpu
if final then
  new_in, new_out, new_gpu = b_in, b_out, b_gpu
else
  new_in, new_out, new_gpu = math.max(r_in, b_in), r_max_out, math.max(r_est, b_gpu)
end
for _, d in ipairs({{'input_tokens', 'input', old_in - new_in}, {'output_tokens', 'output', old_out - new_out}}) do
  local key = d[2] .. '_level'
  if acc[key] ~= nil and d[3] ~= 0 then
    acc[key] = math.min(lim[d[1] .. '_burst'] or 0.0, acc[key] + d[3])
  end
end
acc.gpu_window_used_ms = math.max(0.0, acc.gpu_window_used_ms + new_gpu - old_gpu)
acc.gpu_total_used_ms = math.max(0.0, acc.gpu_total_used_ms + new_gpu - old_gpu)
if final then
  acc.concurrent = math.max(0, acc.concurrent - 1)
  if r.queued == '1' then
    acc.queued = math.max(0, acc.queued - 1)
    r.queued = '0'
  end
end
local run = nil
if r.run_id ~= nil then
  run = load_run(r.run_id)
  run.tokens = math.max(0, run.tokens + (new_in + new_out) - (old_in + old_out))
end
local overage = math.max(0.0, b_gpu - r_est)
local old_overage = tonumber(r.overage_gpu_ms)
local status, event_kind = 'open', 'settle'
if final then
  status = ({settle = 'settled', cancel = 'cancelled', expire = 'expired'})[kind]
  event_kind = kind
  if kind == 'settle' then event_kind = 'settle_final' end
end
r.billed_input_tokens, r.billed_output_tokens, r.billed_gpu_ms = fmt(b_in), fmt(b_out), fmt(b_gpu)
r.overage_gpu_ms, r.status = fmt(overage), status
if final then r.final_ms = fmt(now) end

local out = cjson.encode(r)
hset(RES, rid, out)
save_account(r.model_class, acc)
if run ~= nil then save_run(r.run_id, run) end
add_event(rid, event_kind, 0, b_in - before_in, b_out - before_out, b_gpu - before_gpu, overage - old_overage, now)
if final then
  redis.call('ZREM', OPEN, rid)
  count_status('open', -1)
  count_status(status, 1)
  redis.call('HDEL', HB, rid)
end
touch_all()
return {'ok', out}
"""
)

# ARGV[3..]: reservation id, reservation_ttl_s, from (ms; "" = now). Extends an open reservation to from + TTL.
_EXTEND = (
    _PRELUDE
    + r"""
local rid, ttl_s, since = ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
local raw = redis.call('HGET', RES, rid)
if not raw then return {'not_found'} end
local r = cjson.decode(raw)
if r.status ~= 'open' then return {'final', raw} end
local expires = (since or now_ms()) + ttl_s * 1000.0
r.expires_at_ms = fmt(expires)
local out = cjson.encode(r)
hset(RES, rid, out)
redis.call('ZADD', OPEN, fmt(expires), rid)
expire(OPEN)
touch_all()
return {'ok', out}
"""
)

# ARGV[3..]: reservation id, enter (1: rules.enqueue, 0: rules.dequeue), max_queued or "" (no limit).
# -> {'not_found'} | {'unchanged', json} | {'quota', json} | {'ok', json}
_QUEUE = (
    _PRELUDE
    + r"""
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
"""
)

# ARGV[3]: reservation id. Records a heartbeat if the reservation is open.
_HEARTBEAT = (
    _PRELUDE
    + r"""
local rid = ARGV[3]
local raw = redis.call('HGET', RES, rid)
if not raw then return {'not_found'} end
if cjson.decode(raw).status ~= 'open' then return {'final'} end
hset(HB, rid, fmt(now_ms()))
touch_all()
return {'ok'}
"""
)

# ARGV[3..]: tenant, reason.
_FREEZE = (
    _PRELUDE
    + r"""
redis.call('HSET', FROZEN, 'tenant', ARGV[3], 'reason', ARGV[4], 'at_ms', fmt(now_ms()))
expire(FROZEN)
touch_all()
return {'ok'}
"""
)

# Read-only. ARGV[3]: window_s. -> {events in [now - window, +inf), flat status counts}
_USAGE = (
    _PRELUDE
    + r"""
local since = now_ms() - tonumber(ARGV[3]) * 1000.0
return {redis.call('ZRANGEBYSCORE', EVENTS, fmt(since), '+inf'), redis.call('HGETALL', STATUS)}
"""
)

# Read-only. -> the open reservations due (expires_at_ms <= now), none if the tenant is frozen.
_DUE = (
    _PRELUDE
    + r"""
if redis.call('EXISTS', FROZEN) == 1 then return {} end
local out = {}
for _, rid in ipairs(redis.call('ZRANGEBYSCORE', OPEN, '-inf', fmt(now_ms()))) do
  local raw = redis.call('HGET', RES, rid)
  if raw then out[#out + 1] = raw end
end
return out
"""
)

# Read-only. ARGV[3]: reservation id. -> {last heartbeat ms or '', now}
_BEAT = (
    _PRELUDE
    + r"""
local beat = redis.call('HGET', HB, ARGV[3])
return {beat or '', fmt(now_ms())}
"""
)

# KEYS[1] = P:tenants; ARGV: tag, tenant, retention ms.
_REGISTER = r"""
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""


# --- Python side ---------------------------------------------------------------------------------
def _number(value: float | int) -> str:
    """A number as a string that Lua's ``tonumber`` reads back exactly."""
    return repr(float(value)) if isinstance(value, float) else str(int(value))


def _int(text: str) -> int:
    return int(text) if text.lstrip("-").isdigit() else int(float(text))


def _limits_spec(limits: Limits) -> dict[str, str]:
    spec = {name: _number(getattr(limits, name)) for name in _LIMIT_NAMES if getattr(limits, name) is not None}
    for dimension in ("requests", "input_tokens", "output_tokens"):
        burst = limits.burst(dimension)
        if burst is not None:
            spec[f"{dimension}_burst"] = _number(burst)
    return spec


def _reservation(raw: str) -> Reservation:
    d = json.loads(raw)
    final_ms = d.get("final_ms")
    return Reservation(
        id=d["id"],
        tenant=d["tenant"],
        request_id=d["request_id"],
        model_class=d["model_class"],
        run_id=d.get("run_id"),
        tool_round=d["tool_round"] == "1",
        input_tokens=_int(d["input_tokens"]),
        max_output_tokens=_int(d["max_output_tokens"]),
        gpu_ms_estimate=float(d["gpu_ms_estimate"]),
        status=d["status"],
        billed=Usage(_int(d["billed_input_tokens"]), _int(d["billed_output_tokens"]), float(d["billed_gpu_ms"])),
        overage_gpu_ms=float(d["overage_gpu_ms"]),
        created_ms=float(d["created_ms"]),
        expires_at_ms=float(d["expires_at_ms"]),
        final_ms=None if final_ms is None else float(final_ms),
        queued=d.get("queued") == "1",
    )


def _event(tenant: str, raw: str) -> Event:
    seq, kind, rid, requests, input_tokens, output_tokens, gpu_ms, overage, at_ms = json.loads(raw)
    return Event(
        seq=_int(seq),
        tenant=tenant,
        reservation_id=rid,
        kind=kind,
        requests=_int(requests),
        input_tokens=_int(input_tokens),
        output_tokens=_int(output_tokens),
        gpu_ms=float(gpu_ms),
        overage_gpu_ms=float(overage),
        at_ms=float(at_ms),
    )


def _parse_url(url: str) -> dict[str, Any]:
    """Validate a ``redis://`` / ``rediss://`` ledger URL. Raises ``ValueError`` naming the part at fault."""
    if not isinstance(url, str):
        raise ValueError(f"ledger URL must be a string, got {type(url).__name__}")
    shown = _redacted(url)
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise ValueError(f"ledger URL {shown!r}: malformed ({_one_line(exc)})") from None
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"ledger URL {shown!r}: bad port ({_one_line(exc)})") from None
    if parts.scheme not in ("redis", "rediss"):
        raise ValueError(f"ledger URL {shown!r}: scheme must be redis:// or rediss://, not {parts.scheme!r}")
    if not parts.hostname:
        raise ValueError(f"ledger URL {shown!r}: no host (redis://host:6379/0)")
    if parts.fragment:
        raise ValueError(f"ledger URL {shown!r}: unexpected fragment {'#' + parts.fragment!r}")
    path = parts.path
    if path in ("", "/"):
        db = 0
    elif re.fullmatch(r"/[0-9]{1,9}", path):
        db = int(path[1:])
    else:
        raise ValueError(f"ledger URL {shown!r}: the path {path!r} must be a database number (/0, /1, ...)")
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    names = [name for name, _ in pairs]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"ledger URL {shown!r}: parameter(s) given more than once: {', '.join(map(repr, repeated))}")
    query = dict(pairs)
    tls = parts.scheme == "rediss"
    known = _PARAMS + _TLS_PARAMS
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(
            f"ledger URL {shown!r}: unknown parameter(s) {', '.join(map(repr, unknown))}; known: "
            f"{', '.join(_PARAMS)} and, with rediss://, {', '.join(_TLS_PARAMS)}"
        )
    if not tls and any(name in _TLS_PARAMS for name in names):
        given = ", ".join(name for name in names if name in _TLS_PARAMS)
        raise ValueError(f"ledger URL {shown!r}: TLS parameter(s) {given} need rediss://")
    prefix = query.get("prefix", DEFAULT_PREFIX)
    if not _PREFIX.match(prefix):
        raise ValueError(f"ledger URL: prefix {prefix!r} must match {_PREFIX.pattern}")
    retention = query.get("retention_days", str(DEFAULT_RETENTION_DAYS))
    retention_days = _float(retention)
    if not 1.0 <= retention_days <= 3650.0:
        raise ValueError(f"ledger URL: retention_days {retention!r} must be a number of days in [1, 3650]")
    timeout = query.get("timeout_s", str(DEFAULT_TIMEOUT_S))
    timeout_s = _float(timeout)
    if not 0 < timeout_s <= 600:
        raise ValueError(f"ledger URL: timeout_s {timeout!r} must be a number of seconds in (0, 600]")
    connection: dict[str, Any] = {"host": parts.hostname, "port": port or 6379, "db": db}
    if parts.username:
        connection["username"] = unquote(parts.username)
    if parts.password:
        connection["password"] = unquote(parts.password)
    if "ssl_cert_reqs" in query:
        if query["ssl_cert_reqs"] not in ("none", "optional", "required"):
            raise ValueError(f"ledger URL: ssl_cert_reqs {query['ssl_cert_reqs']!r} must be none, optional or required")
        connection["ssl_cert_reqs"] = query["ssl_cert_reqs"]
    if "ssl_check_hostname" in query:
        if query["ssl_check_hostname"].lower() not in _BOOLS:
            raise ValueError(f"ledger URL: ssl_check_hostname {query['ssl_check_hostname']!r} must be true or false")
        connection["ssl_check_hostname"] = _BOOLS[query["ssl_check_hostname"].lower()]
    for name in _TLS_FILES:
        if name in query:
            if not os.path.isfile(query[name]):
                raise ValueError(f"ledger URL: {name} {query[name]!r} is not a file")
            connection[name] = query[name]
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return {
        "prefix": prefix,
        "retention_days": retention_days,
        "timeout_s": timeout_s,
        "tls": tls,
        "where": f"{host}:{port or 6379}",
        "connection": connection,
    }


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        return math.nan
    return value if math.isfinite(value) else math.nan


def _describe(exc: BaseException, where: str, timeout_s: float, tls: bool) -> str:
    """One line naming the real cause of a redis-py (or socket) failure talking to ``where``."""
    text = _one_line(exc) or type(exc).__name__
    if isinstance(exc, (redis.exceptions.TimeoutError, TimeoutError)):
        hint = (
            "; the URL asks for TLS (rediss://): does the server speak TLS?"
            if tls and "connecting" in text.lower()
            else ""
        )
        return f"redis ledger: {where} did not answer within {timeout_s:g} s ({text}){hint}"
    if isinstance(exc, redis.exceptions.InvalidResponse):
        return f"redis ledger: {where} does not speak the Redis protocol ({text})"
    if isinstance(exc, redis.exceptions.AuthenticationError):
        return f"redis ledger: {where} refused the credentials: {text}"
    if isinstance(exc, redis.exceptions.ResponseError) or type(exc) is redis.exceptions.BusyLoadingError:
        code = getattr(exc, "status_code", None)
        reply = f"{code} {text}" if code and not text.startswith(code) else text
        return f"redis ledger: {where} replied with an error: {reply}"
    if where in text:
        return f"redis ledger: {text}"
    return f"redis ledger: {where}: {text}"


def _is_redis_failure(exc: BaseException) -> bool:
    return isinstance(exc, (redis.exceptions.RedisError, OSError))


def check_url(url: str) -> None:
    """Check a Redis ledger URL without connecting. Raises ``ValueError``."""
    _parse_url(url)


async def open_ledger(url: str, quotas: Quotas, clock: Callable[[], float] | None, create: bool) -> Ledger:
    """``RedisLedger.open``."""
    return await RedisLedger.open(url, quotas, clock, create=create)


class RedisLedger(Backend):
    """Ledger on Redis. Build with ``await RedisLedger.open(url, quotas)`` (see the module docstring).

    All times are ms since the epoch on the ledger clock (the server's ``TIME``, or ``clock``).
    """

    def __init__(
        self,
        client: Redis,
        prefix: str,
        quotas: Quotas,
        clock: Callable[[], float] | None,
        retention_s: float,
        where: str = "redis",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        tls: bool = False,
    ) -> None:
        super().__init__(quotas)
        self._client = client
        self.prefix = prefix
        self._where = where  # host:port, for messages
        self.timeout_s = timeout_s
        self._tls = tls
        self.retention_ms = int(retention_s * 1000)
        self._clock = clock
        self._registered: dict[str, float] = {}  # tenant -> time.monotonic() of the last registration
        self._tenant_by_tag = {tenant_tag(name): name for name in quotas.tenants}
        self._limits_json = {
            tenant_tag(name): json.dumps(
                {
                    "base": _limits_spec(t.limits),
                    "classes": {mc: _limits_spec(lim) for mc, lim in t.by_model_class.items()},
                }
            )
            for name, t in quotas.tenants.items()
        }
        self._reserve_script = client.register_script(_RESERVE)
        self._close_script = client.register_script(_CLOSE)
        self._extend_script = client.register_script(_EXTEND)
        self._heartbeat = client.register_script(_HEARTBEAT)
        self._queue_script = client.register_script(_QUEUE)
        self._freeze = client.register_script(_FREEZE)
        self._usage = client.register_script(_USAGE)
        self._due_script = client.register_script(_DUE)
        self._beat = client.register_script(_BEAT)
        self._register = client.register_script(_REGISTER)

    @classmethod
    async def open(
        cls,
        url: str,
        quotas: Quotas,
        clock: Callable[[], float] | None = None,
        max_connections: int = 64,
        *,
        create: bool = True,
    ) -> RedisLedger:
        """Connect to the server named by ``url``
        (``redis://host:port/db?prefix=NAME&retention_days=35&timeout_s=2``; see the module docstring).

        Args:
            clock: ms since the epoch, replacing the server's ``TIME`` (tests).
            max_connections: connections in the pool; a call waits up to ``POOL_WAIT_S`` for a free one.
            create: with ``False`` the ledger must exist already (the prefix's tenant registry or any key
                under the prefix): operator commands use it so that a mistyped URL does not quietly
                address an empty ledger. With ``True`` (the default) nothing needs to exist: keys are
                created by the first write.

        Raises:
            ValueError: a bad URL (scheme, host, port, database path, an unknown or repeated parameter, a
                bad ``prefix``, ``retention_days``, ``timeout_s`` or TLS parameter), or a database number
                the server does not have.
            LedgerUnavailable: the server cannot be reached, does not answer within ``timeout_s``, does not
                speak Redis, refuses the credentials or replies with an error; or ``create=False`` and
                there is no ledger under the prefix.
        """
        settings = _parse_url(url)
        prefix, timeout_s, where, tls = settings["prefix"], settings["timeout_s"], settings["where"], settings["tls"]
        # One retry, and only for a connection found closed (a stale pooled connection after a server
        # restart): a server that does not answer fails after one timeout, not after a retry storm.
        retry = Retry(ExponentialBackoff(cap=0.2, base=0.05), 1, supported_errors=(redis.exceptions.ConnectionError,))
        pool = BlockingConnectionPool(
            connection_class=SSLConnection if tls else Connection,
            max_connections=max_connections,
            timeout=max(POOL_WAIT_S, timeout_s),
            decode_responses=True,
            socket_connect_timeout=timeout_s,
            socket_timeout=timeout_s,
            retry=retry,
            **settings["connection"],
        )
        client = Redis.from_pool(pool)
        ledger = cls(client, prefix, quotas, clock, settings["retention_days"] * 86_400.0, where, timeout_s, tls)
        try:
            try:
                await client.ping()
            except redis.exceptions.ResponseError as exc:
                if "DB index" in str(exc):
                    raise ValueError(
                        f"ledger URL: database {settings['connection']['db']} (the URL path) does not "
                        f"exist on {where}: {_one_line(exc)}"
                    ) from None
                raise
            with ledger._unavailable():
                for script in (_RESERVE, _CLOSE, _EXTEND, _HEARTBEAT, _FREEZE, _USAGE, _DUE, _BEAT, _REGISTER):
                    await client.script_load(script)
                if not create and not await ledger._exists():
                    raise LedgerUnavailable(
                        f"redis ledger: no ledger at {_redacted(url)} (create=False): no key "
                        f"under the prefix {prefix!r}"
                    )
        except BaseException as exc:
            await client.aclose()
            if _is_redis_failure(exc):
                raise LedgerUnavailable(_describe(exc, where, timeout_s, tls)) from None
            raise
        return ledger

    async def _exists(self) -> bool:
        """Whether anything of this ledger is stored: the tenant registry, or any key under the prefix."""
        if await self._client.exists(self._tenants_key):
            return True
        for pattern in (f"{{{self.prefix}:*", f"{self.prefix}:*"):
            cursor = 0
            while True:
                cursor, keys = await self._client.scan(cursor, match=pattern, count=1000)
                if keys:
                    return True
                if int(cursor) == 0:
                    break
        return False

    @contextmanager
    def _unavailable(self) -> Iterator[None]:
        """Map every redis-py failure (connection, timeout, protocol, error reply) to a one-line
        ``LedgerUnavailable`` naming the cause; an argument redis-py cannot send (``DataError``) is the
        caller's ``InvalidUsage``."""
        try:
            yield
        except redis.exceptions.DataError as exc:  # redis-py refused an argument: the caller's input, not the server
            raise InvalidUsage(f"redis ledger: {_one_line(exc) or 'invalid argument'}") from None
        except (redis.exceptions.RedisError, OSError) as exc:
            raise LedgerUnavailable(_describe(exc, self._where, self.timeout_s, self._tls)) from None

    # --- keys and plumbing -----------------------------------------------------------------------
    def _keys(self, tag: str) -> list[str]:
        """The tenant's keys (TENANT_KEYS order), all in the hash slot of ``{prefix:tag}``."""
        return [f"{{{self.prefix}:{tag}}}:{name}" for name in TENANT_KEYS]

    @property
    def _tenants_key(self) -> str:
        return f"{self.prefix}:tenants"

    def _head(self) -> list[str]:
        """ARGV[1..2]: the clock (empty: the server's TIME) and the retention TTL in ms."""
        return ["" if self._clock is None else _number(float(self._clock())), str(self.retention_ms)]

    @staticmethod
    def _tag_of(reservation_id: object) -> str | None:
        """The tenant tag a reservation id starts with (None: not an id this ledger makes)."""
        match = _RESERVATION_ID.match(check_reservation_id(reservation_id))
        return match.group(1) if match else None

    async def _ensure_registered(self, tenant: str) -> None:
        last = self._registered.get(tenant)
        if last is not None and time.monotonic() - last < REGISTER_EVERY_S:
            return
        await self._register(keys=[self._tenants_key], args=[tenant_tag(tenant), tenant, str(self.retention_ms)])
        self._registered[tenant] = time.monotonic()

    async def _tenants(self) -> dict[str, str]:
        """Registered tenants: tag -> name."""
        return dict(await self._client.hgetall(self._tenants_key))

    # --- API --------------------------------------------------------------------------------------
    async def _reserve(self, args: rules.ReserveArgs, limits: Limits) -> Reservation:
        """One script: reads the request id's reservation, the account and the run; writes only if all fit."""
        tenant = args.tenant
        tag = tenant_tag(tenant)
        with self._unavailable():
            await self._ensure_registered(tenant)
            reply = await self._reserve_script(
                keys=self._keys(tag),
                args=[
                    *self._head(),
                    tenant,
                    args.request_id,
                    new_reservation_id(tenant),
                    str(args.input_tokens),
                    str(args.max_output_tokens),
                    _number(float(args.gpu_ms_estimate)),
                    args.model_class,
                    args.run_id or "",
                    "0" if args.run_id is None else "1",
                    "1" if args.tool_round else "0",
                    json.dumps(_limits_spec(limits)),
                ],
            )
        code = reply[0]
        if code == "quota":
            dimension, retry, remaining = reply[1], reply[2], float(reply[3])
            raise QuotaExceeded(
                tenant,
                dimension,
                None if retry == "" else float(retry),
                getattr(limits, dimension),
                int(remaining) if dimension in _INT_REMAINING else remaining,
            )
        r = _reservation(reply[1])
        return rules.check_retry(r, args) if code == "existing" else r

    async def _close_call(
        self, reservation_id: str, kind: str, final: bool, billed: Usage | None, check_frozen: bool = True
    ) -> list[Any]:
        tag = self._tag_of(reservation_id)
        if tag is None:
            return ["not_found"]
        amounts = (
            ["", "", ""]
            if billed is None
            else [str(billed.input_tokens), str(billed.output_tokens), _number(float(billed.gpu_ms))]
        )
        with self._unavailable():
            reply: list[Any] = await self._close_script(
                keys=self._keys(tag),
                args=[
                    *self._head(),
                    reservation_id,
                    kind,
                    "1" if final else "0",
                    *amounts,
                    "1" if check_frozen else "0",
                    self._limits_json.get(tag, ""),
                ],
            )
        return reply

    async def _close(self, reservation_id: str, billed: Usage, final: bool, kind: str) -> Reservation:
        reply = await self._close_call(reservation_id, kind, final, billed)
        code = reply[0]
        if code == "not_found":
            raise ReservationNotFound(f"no reservation {reservation_id!r}")
        r = _reservation(reply[-1])
        if code == "final":
            return rules.check_final_again(r, billed, final, kind)
        if code == "frozen":
            raise SettlementFrozen(f"automatic settlement is frozen for tenant {r.tenant!r}")
        if code == "unknown_tenant":
            raise UnknownTenant(f"tenant {r.tenant!r} has no quota configuration")
        if code in ("above", "above_input", "below"):
            rules.check_billing(r, billed, kind)  # the script found them invalid: the rules say why
            raise InvalidUsage(f"{kind}: invalid amounts {billed}")
        return r  # ok | unchanged

    async def account(self, tenant: str, model_class: str = "default") -> rules.Account:
        """The balances held for ``tenant`` and ``model_class`` as last written (buckets not refilled).

        Raises:
            LedgerUnavailable.
        """
        with self._unavailable():
            raw = await self._client.hget(self._keys(tenant_tag(tenant))[0], model_class)
        if raw is None:
            return rules.Account()
        stored = json.loads(raw)
        values: dict[str, Any] = {name: float(text) for name, text in stored.items()}
        values["concurrent"] = _int(stored.get("concurrent", "0"))
        values["queued"] = _int(stored.get("queued", "0"))
        return rules.Account(**values)

    async def get(self, reservation_id: str) -> Reservation:
        """The reservation. Raises ``ReservationNotFound``, ``InvalidUsage`` (not a string), ``LedgerUnavailable``."""
        tag = self._tag_of(reservation_id)
        raw = None
        if tag is not None:
            with self._unavailable():
                raw = await self._client.hget(self._keys(tag)[2], reservation_id)
        if raw is None:
            raise ReservationNotFound(f"no reservation {reservation_id!r}")
        return _reservation(raw)

    async def usage(self, tenant: str, window_s: float) -> TenantUsage:
        """The tenant's billed usage over the last ``window_s`` seconds (from the event log) and its
        reservations by status. Raises ``InvalidUsage`` (window not > 0), ``LedgerUnavailable``."""
        check_name(tenant, "tenant")
        window_s = check_window(window_s)
        with self._unavailable():
            events_raw, flat = await self._usage(
                keys=self._keys(tenant_tag(tenant)), args=[*self._head(), _number(window_s)]
            )
        events = sorted((_event(tenant, raw) for raw in events_raw), key=lambda e: e.seq)
        by_status = {flat[i]: int(flat[i + 1]) for i in range(0, len(flat), 2) if int(flat[i + 1]) > 0}
        return usage_from_events(tenant, window_s, events, by_status)

    async def reservations(self, tenant: str | None = None, status: str | None = None) -> list[Reservation]:
        """Reservations ordered by ``created_ms`` then id, optionally of one tenant and/or status.

        Raises:
            InvalidUsage (a bad tenant or status), LedgerUnavailable.
        """
        check_filters(tenant, status)
        with self._unavailable():
            tags = [tenant_tag(tenant)] if tenant is not None else sorted(await self._tenants())
            found: list[Reservation] = []
            for tag in tags:
                found.extend(_reservation(raw) for raw in await self._client.hvals(self._keys(tag)[2]))
        return sorted((r for r in found if status is None or r.status == status), key=lambda r: (r.created_ms, r.id))

    async def events(self, tenant: str | None = None) -> list[Event]:
        """The event log in order: one tenant's by its sequence; all tenants' merged by ``at_ms``
        (each tenant's own order kept; ``seq`` is per tenant). Raises ``LedgerUnavailable``."""
        check_name(tenant, "tenant", optional=True)
        with self._unavailable():
            tenants = {tenant_tag(tenant): tenant} if tenant is not None else await self._tenants()
            logs = []
            for tag in sorted(tenants):
                raws = await self._client.zrange(self._keys(tag)[6], 0, -1)
                logs.append(sorted((_event(tenants[tag], raw) for raw in raws), key=lambda e: e.seq))
        if len(logs) == 1:
            return logs[0]
        return list(heapq.merge(*logs, key=lambda e: e.at_ms))

    async def _queue_step(self, reservation_id: str, enter: bool) -> Reservation:
        tag = self._tag_of(reservation_id)
        reply: list[Any] = ["not_found"]
        if tag is not None:
            limit = ""
            if enter:
                r = await self.get(reservation_id)
                max_queued = self.limits(r.tenant, r.model_class).max_queued
                limit = "" if max_queued is None else str(max_queued)
            with self._unavailable():
                reply = await self._queue_script(
                    keys=self._keys(tag), args=[*self._head(), reservation_id, "1" if enter else "0", limit]
                )
        if reply[0] == "not_found":
            raise ReservationNotFound(f"no reservation {reservation_id!r}")
        r = _reservation(reply[1])
        if reply[0] == "quota":
            raise rules.queue_full(r, self.limits(r.tenant, r.model_class))
        return r

    async def heartbeat(self, reservation_id: str) -> None:
        """Record that the request behind ``reservation_id`` is running now (no-op once final).

        Raises:
            ReservationNotFound, InvalidUsage (not a string), LedgerUnavailable.
        """
        tag = self._tag_of(reservation_id)
        reply = ["not_found"]
        if tag is not None:
            with self._unavailable():
                reply = await self._heartbeat(keys=self._keys(tag), args=[*self._head(), reservation_id])
        if reply[0] == "not_found":
            raise ReservationNotFound(f"no reservation {reservation_id!r}")

    async def _last_beat_ms(self, r: Reservation) -> tuple[float | None, float]:
        """(its last heartbeat or None, now), ms on the ledger clock."""
        with self._unavailable():
            beat, now = await self._beat(keys=self._keys(tenant_tag(r.tenant)), args=[*self._head(), r.id])
        return (float(beat) if beat not in ("", b"") else None), float(now)

    async def _due(self) -> list[Reservation]:
        with self._unavailable():
            due: list[Reservation] = []
            for tag in sorted(await self._tenants()):
                due.extend(_reservation(raw) for raw in await self._due_script(keys=self._keys(tag), args=self._head()))
        due.sort(key=lambda r: (r.expires_at_ms, r.created_ms, r.id))
        return due

    async def _extend(self, r: Reservation, ttl_s: float, since_ms: float | None) -> None:
        with self._unavailable():
            await self._extend_script(
                keys=self._keys(tenant_tag(r.tenant)),
                args=[*self._head(), r.id, _number(float(ttl_s)), "" if since_ms is None else _number(since_ms)],
            )

    async def _expire(self, r: Reservation) -> Reservation | None:
        """Expires in the close script, which skips a reservation no longer due or whose tenant is frozen."""
        reply = await self._close_call(r.id, "expire", True, None)
        code = reply[0]
        if code == "ok" or (code == "final" and _reservation(reply[-1]).status == "expired"):
            return _reservation(reply[-1])
        if code == "unknown_tenant":
            raise UnknownTenant(f"tenant {r.tenant!r} has no quota configuration")
        return None  # final (settled or cancelled meanwhile), not_due (extended meanwhile), frozen, not_found

    async def freeze(self, tenant: str, reason: str) -> None:
        """Stop automatic settlement for ``tenant`` (settle/cancel raise ``SettlementFrozen``, the sweeper
        skips it). Raises ``LedgerUnavailable``."""
        with self._unavailable():
            await self._ensure_registered(tenant)
            await self._freeze(keys=self._keys(tenant_tag(tenant)), args=[*self._head(), tenant, reason])

    async def unfreeze(self, tenant: str) -> None:
        """Resume automatic settlement for ``tenant``. Raises ``LedgerUnavailable``."""
        with self._unavailable():
            await self._client.delete(self._keys(tenant_tag(tenant))[9])

    async def frozen(self) -> dict[str, str]:
        """Frozen tenants and why, by tenant name. Raises ``LedgerUnavailable``."""
        with self._unavailable():
            found = {}
            for tag, name in (await self._tenants()).items():
                reason = await self._client.hget(self._keys(tag)[9], "reason")
                if reason is not None:
                    found[name] = reason
        return dict(sorted(found.items()))

    async def add_charges(self, scope: str, deltas: dict[str, ChargeTotals]) -> dict[str, ChargeTotals]:
        """``Ledger.add_charges``: one hash per scope (``{P:charges}:SCOPE``, fields ``TENANT\ngpu_ms`` /
        ``\ninput`` / ``\noutput``), updated and read in one MULTI/EXEC. Raises ``LedgerUnavailable``."""
        key = f"{{{self.prefix}:charges}}:{scope}"
        with self._unavailable():
            async with self._client.pipeline(transaction=True) as pipe:
                for tenant, (gpu_ms, tokens_in, tokens_out) in sorted(deltas.items()):
                    pipe.hincrbyfloat(key, f"{tenant}\ngpu_ms", float(gpu_ms))
                    pipe.hincrby(key, f"{tenant}\ninput", int(tokens_in))
                    pipe.hincrby(key, f"{tenant}\noutput", int(tokens_out))
                pipe.hgetall(key)
                fields = (await pipe.execute())[-1]
        totals: dict[str, list[float]] = {}
        for field, value in fields.items():
            name, _, part = (field.decode() if isinstance(field, bytes) else field).rpartition("\n")
            totals.setdefault(name, [0.0, 0, 0])[("gpu_ms", "input", "output").index(part)] = float(value)
        return {
            tenant: (gpu_ms, int(tokens_in), int(tokens_out))
            for tenant, (gpu_ms, tokens_in, tokens_out) in totals.items()
        }

    async def share_occupancy(
        self, process: str, occupancy: dict[str, tuple[float, float]], stale_after_ms: float
    ) -> dict[str, tuple[float, float]]:
        """``Ledger.share_occupancy``: a hash per process (``{P:occupancy}:PROCESS``, field UPSTREAM, value
        ``"SEQUENCES PREFILL_SHARE"``) that expires ``stale_after_ms`` after its last write, and a set of the
        processes (``{P:occupancy}``); two round trips. Raises ``LedgerUnavailable``."""
        members = f"{{{self.prefix}:occupancy}}"
        mine = f"{members}:{process}"
        with self._unavailable():
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.delete(mine)
                if occupancy:
                    pipe.hset(
                        mine,
                        mapping={
                            upstream: f"{float(sequences)!r} {float(prefill_share)!r}"
                            for upstream, (sequences, prefill_share) in occupancy.items()
                        },
                    )
                    pipe.pexpire(mine, max(1, int(stale_after_ms)))
                pipe.sadd(members, process)
                pipe.smembers(members)
                processes = sorted(p.decode() if isinstance(p, bytes) else p for p in (await pipe.execute())[-1])
            others = [p for p in processes if p != process]
            async with self._client.pipeline(transaction=False) as pipe:
                for other in others:
                    pipe.hgetall(f"{members}:{other}")
                published = await pipe.execute()
            gone = [other for other, fields in zip(others, published) if not fields]
            if gone:
                await self._client.srem(members, *gone)
        totals: dict[str, tuple[float, float]] = {}
        for fields in published:
            for upstream, value in fields.items():
                name = upstream.decode() if isinstance(upstream, bytes) else upstream
                sequences, prefill_share = map(float, (value.decode() if isinstance(value, bytes) else value).split())
                before = totals.get(name, (0.0, 0.0))
                totals[name] = (before[0] + sequences, before[1] + prefill_share)
        return totals

    async def close(self) -> None:
        """Close the connection pool."""
        await self._client.aclose()

    async def drop_keys(self) -> None:
        """Delete every key of this ledger's prefix (tests). Raises ``LedgerUnavailable``."""
        with self._unavailable():
            for pattern in (f"{{{self.prefix}:*", f"{self.prefix}:*"):
                batch: list[str] = []
                async for key in self._client.scan_iter(match=pattern, count=500):
                    batch.append(key)
                    if len(batch) >= 500:
                        await self._client.delete(*batch)
                        batch = []
                if batch:
                    await self._client.delete(*batch)
        self._registered.clear()


__all__ = ["DEFAULT_PREFIX", "DEFAULT_RETENTION_DAYS", "TENANT_KEYS", "RedisLedger"]
