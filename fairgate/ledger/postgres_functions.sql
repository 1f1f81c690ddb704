-- The PostgreSQL ledger's request path as server-side functions: rules.py, step for step, in PL/pgSQL
-- (redis/scripts/*.lua are the same port for Redis). Each call is one statement on an autocommit connection,
-- so it is its own transaction: the tenant's advisory lock is taken inside it and released at its end, and a
-- refusal (RAISE) rolls back everything it wrote.
--
-- postgres_functions.py loads this file and qualifies every fg_ name with the ledger's schema; the statements
-- are separated by lines of '-- ;;' (function bodies hold semicolons).
--
-- Calls whose result is not needed are assigned (v_ok := f(...)), not PERFORMed: PERFORM runs a query through
-- the executor, an assignment of a call evaluates it as a simple expression.
--
-- Doubles: every float is computed with the same IEEE operations in the same order as rules.py and
-- core/ratelimit.py (PL/pgSQL evaluates left to right as Python does), so the books agree to the bit.
--
-- Limits come as float8[], 18 per book, NULL where there is no limit, in the order of
-- postgres_functions.LIMIT_ORDER: 1 requests_per_minute, 2 input_tokens_per_minute, 3 output_tokens_per_minute,
-- 4-6 their bursts (Limits.burst), 7 max_tokens_per_request, 8 max_concurrent, 9 max_queued, 10 gpu_seconds,
-- 11 gpu_window_s, 12 gpu_seconds_total, 13 max_model_calls, 14 max_tool_rounds, 15 max_tokens,
-- 16 reservation_ttl_s, 17 spend_budget, 18 spend_period (1 day, 2 month: periods.PERIOD_CODES).
--
-- Refusals are SQLSTATEs of class FG, the fields in DETAIL (postgres_functions.Refused.error maps them back):
-- FG001 quota: '<dimension> <retry_after_s as float8send hex, or -> <remaining, hex> <account key>';
-- FG002 no such reservation; FG003 settlement frozen: '<tenant>'; FG004 amounts that do not fit:
-- '<max_output_tokens> <billed input> <billed output> <billed gpu_ms, hex>' (what was billed before);
-- FG005 final already (claim): '<status>'; FG006 unknown tenant: '<tenant>'.

-- Python's float x % y for y > 0, exactly (fmod is exact; x - floor(x / y) * y is not).
CREATE OR REPLACE FUNCTION fg_fmod(x float8, y float8) RETURNS float8 LANGUAGE plpgsql IMMUTABLE STRICT AS $$
DECLARE
  v_r float8 := abs(x);
  v_t float8;
BEGIN
  IF v_r = trunc(v_r) AND y = trunc(y) AND v_r < 9007199254740992 AND y < 9007199254740992 THEN
    v_r := (v_r::bigint % y::bigint)::float8;  -- whole numbers below 2^53: exact
  ELSE
    WHILE v_r >= y LOOP  -- shift and subtract: each v_r - v_t has v_t <= v_r < 2 v_t, so it is exact
      v_t := y;
      WHILE v_t * 2.0::float8 <= v_r LOOP
        v_t := v_t * 2.0::float8;
      END LOOP;
      v_r := v_r - v_t;
    END LOOP;
  END IF;
  IF x < 0 AND v_r <> 0 THEN
    RETURN y - v_r;  -- Python's sign: that of the divisor
  END IF;
  RETURN v_r;
END $$;
-- ;;
-- The exact floor of x / y for whole y > 0 (the division may round up to the next whole number).
CREATE OR REPLACE FUNCTION fg_floor_div(x float8, y float8) RETURNS bigint LANGUAGE sql IMMUTABLE AS $$
  SELECT (floor(x / y) - CASE WHEN floor(x / y) * y > x THEN 1 ELSE 0 END)::bigint
$$;
-- ;;
-- periods.period_start_ms (p_period: 1 day, else month) and, to_next, next_period_start_ms. PostgreSQL's dates
-- are the proleptic Gregorian calendar, as periods.py's day arithmetic: the same month starts, whole days (on
-- timestamps without a time zone: the session's TimeZone plays no part). One SQL expression, inlined where used.
CREATE OR REPLACE FUNCTION fg_period_start(at_ms float8, p_period float8, to_next boolean) RETURNS float8
LANGUAGE sql IMMUTABLE AS $$
  SELECT CASE WHEN p_period = 1
    THEN ((fg_floor_div(at_ms, 86400000) + CASE WHEN to_next THEN 1 ELSE 0 END) * 86400000)::float8
    ELSE (((date_trunc('month', (DATE '1970-01-01' + fg_floor_div(at_ms, 86400000)::integer)::timestamp)
      + CASE WHEN to_next THEN interval '1 month' ELSE interval '0' END)::date - DATE '1970-01-01')::bigint
      * 86400000)::float8
  END
$$;
-- ;;
-- Price.spend_micros, left to right.
CREATE OR REPLACE FUNCTION fg_spend(p_in float8, p_out float8, p_gpu float8, a bigint, b bigint, g float8)
RETURNS float8 LANGUAGE sql IMMUTABLE AS $$
  SELECT a::float8 * p_in + b::float8 * p_out + g * p_gpu
$$;
-- ;;
-- A refusal on a quota (FG001): nothing the call wrote stays.
CREATE OR REPLACE FUNCTION fg_refuse(dimension text, retry_s float8, remaining float8, account_key text)
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
  RAISE EXCEPTION USING ERRCODE = 'FG001', MESSAGE = 'quota ' || dimension || ' exceeded',
    DETAIL = dimension || ' ' || coalesce(encode(float8send(retry_s), 'hex'), '-') || ' '
      || encode(float8send(remaining), 'hex') || ' ' || account_key;
END $$;
-- ;;
-- The account as stored, or a new one (rules.Account's defaults).
CREATE OR REPLACE FUNCTION fg_account(p_tenant text, p_key text) RETURNS fg_accounts LANGUAGE plpgsql STABLE AS $$
DECLARE
  v_a fg_accounts;
BEGIN
  SELECT * INTO v_a FROM fg_accounts WHERE tenant = p_tenant AND model_class = p_key;
  IF NOT FOUND THEN
    v_a.tenant := p_tenant;
    v_a.model_class := p_key;
    v_a.requests_updated_ms := 0.0;
    v_a.input_updated_ms := 0.0;
    v_a.output_updated_ms := 0.0;
    v_a.concurrent := 0;
    v_a.gpu_window_start_ms := 0.0;
    v_a.gpu_window_used_ms := 0.0;
    v_a.gpu_total_used_ms := 0.0;
    v_a.queued := 0;
    v_a.spend_period_start_ms := 0.0;
    v_a.spend_used_micros := 0.0;
  END IF;
  RETURN v_a;
END $$;
-- ;;
-- PL/pgSQL, not SQL: its statements' plans are kept for the session (a SQL function's are made at every call).
-- An UPDATE first: the account is there but for a tenant's first call, and an upsert that finds its row locks it
-- (a WAL record of its own) before updating it. With fg_add_event's the same: 25 WAL records per gateway request
-- instead of 29. The upsert stays for the first call, and for a writer that made the row meanwhile.
CREATE OR REPLACE FUNCTION fg_save_account(a fg_accounts) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
  UPDATE fg_accounts SET requests_level = a.requests_level, requests_updated_ms = a.requests_updated_ms,
    input_level = a.input_level, input_updated_ms = a.input_updated_ms, output_level = a.output_level,
    output_updated_ms = a.output_updated_ms, concurrent = a.concurrent, gpu_window_start_ms = a.gpu_window_start_ms,
    gpu_window_used_ms = a.gpu_window_used_ms, gpu_total_used_ms = a.gpu_total_used_ms, queued = a.queued,
    spend_period_start_ms = a.spend_period_start_ms, spend_used_micros = a.spend_used_micros
    WHERE tenant = a.tenant AND model_class = a.model_class;
  IF FOUND THEN
    RETURN true;
  END IF;
  INSERT INTO fg_accounts (tenant, model_class, requests_level, requests_updated_ms, input_level, input_updated_ms,
    output_level, output_updated_ms, concurrent, gpu_window_start_ms, gpu_window_used_ms, gpu_total_used_ms, queued,
    spend_period_start_ms, spend_used_micros)
  VALUES (a.tenant, a.model_class, a.requests_level, a.requests_updated_ms, a.input_level, a.input_updated_ms,
    a.output_level, a.output_updated_ms, a.concurrent, a.gpu_window_start_ms, a.gpu_window_used_ms,
    a.gpu_total_used_ms, a.queued, a.spend_period_start_ms, a.spend_used_micros)
  ON CONFLICT (tenant, model_class) DO UPDATE SET requests_level = excluded.requests_level,
    requests_updated_ms = excluded.requests_updated_ms, input_level = excluded.input_level,
    input_updated_ms = excluded.input_updated_ms, output_level = excluded.output_level,
    output_updated_ms = excluded.output_updated_ms, concurrent = excluded.concurrent,
    gpu_window_start_ms = excluded.gpu_window_start_ms, gpu_window_used_ms = excluded.gpu_window_used_ms,
    gpu_total_used_ms = excluded.gpu_total_used_ms, queued = excluded.queued,
    spend_period_start_ms = excluded.spend_period_start_ms, spend_used_micros = excluded.spend_used_micros;
  RETURN true;
END $$;
-- ;;
-- ratelimit.refill at a rate per minute, its two results one function each (one SQL expression each, inlined
-- where used: a pair as an array costs a PL/pgSQL array per bucket). A NULL level is a new bucket, full now; a
-- NULL rate, no bucket: the level and its time as they are.
CREATE OR REPLACE FUNCTION fg_refill_level(level float8, updated_ms float8, now_ms float8, rate float8, burst float8)
RETURNS float8 LANGUAGE sql IMMUTABLE AS $$
  SELECT CASE WHEN rate IS NULL THEN level WHEN level IS NULL THEN burst
    ELSE least(burst, level + greatest(0.0::float8, now_ms - updated_ms) * rate / 60000.0::float8) END
$$;
-- ;;
CREATE OR REPLACE FUNCTION fg_refill_time(level float8, updated_ms float8, now_ms float8, rate float8)
RETURNS float8 LANGUAGE sql IMMUTABLE AS $$
  SELECT CASE WHEN rate IS NULL THEN updated_ms WHEN level IS NULL THEN now_ms ELSE greatest(updated_ms, now_ms) END
$$;
-- ;;
-- rules.refreshed: the book at offset o of lim (its limits) brought up to now; both of a bucket's results come
-- from its level as read (v_level).
CREATE OR REPLACE FUNCTION fg_refreshed(a fg_accounts, lim float8[], o integer, now_ms float8) RETURNS fg_accounts
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
  v_window_ms float8 := lim[o + 11] * 1000.0::float8;
  v_start float8;
  v_level float8;
BEGIN
  v_level := a.requests_level;
  a.requests_level := fg_refill_level(v_level, a.requests_updated_ms, now_ms, lim[o + 1], coalesce(lim[o + 4], 0.0));
  a.requests_updated_ms := fg_refill_time(v_level, a.requests_updated_ms, now_ms, lim[o + 1]);
  v_level := a.input_level;
  a.input_level := fg_refill_level(v_level, a.input_updated_ms, now_ms, lim[o + 2], coalesce(lim[o + 5], 0.0));
  a.input_updated_ms := fg_refill_time(v_level, a.input_updated_ms, now_ms, lim[o + 2]);
  v_level := a.output_level;
  a.output_level := fg_refill_level(v_level, a.output_updated_ms, now_ms, lim[o + 3], coalesce(lim[o + 6], 0.0));
  a.output_updated_ms := fg_refill_time(v_level, a.output_updated_ms, now_ms, lim[o + 3]);
  IF now_ms >= a.gpu_window_start_ms + v_window_ms THEN
    a.gpu_window_start_ms := now_ms - fg_fmod(now_ms, v_window_ms);
    a.gpu_window_used_ms := 0.0;
  END IF;
  v_start := fg_period_start(now_ms, coalesce(lim[o + 18], 2), false);
  IF v_start > a.spend_period_start_ms THEN
    a.spend_period_start_ms := v_start;
    a.spend_used_micros := 0.0;
  END IF;
  RETURN a;
END $$;
-- ;;
-- An event and its addition to its tenant's minute (schema.event_writes, usage_minutes.py): an UPDATE of the
-- minute first, as fg_save_account's (the minute is there but for its first event).
CREATE OR REPLACE FUNCTION fg_add_event(
  p_tenant text, p_rid text, p_kind text, p_requests integer, d_in bigint, d_out bigint, d_gpu float8,
  d_over float8, d_spend float8, p_now float8) RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
  v_minute bigint := fg_floor_div(p_now, 60000);
BEGIN
  INSERT INTO fg_events (tenant, reservation_id, kind, requests, input_tokens, output_tokens, gpu_ms, overage_gpu_ms,
    at_ms, spend_micros) VALUES (p_tenant, p_rid, p_kind, p_requests, d_in, d_out, d_gpu, d_over, p_now, d_spend);
  UPDATE fg_usage_minutes SET requests = requests + p_requests, input_tokens = input_tokens + d_in,
    output_tokens = output_tokens + d_out, gpu_ms = gpu_ms + d_gpu, overage_gpu_ms = overage_gpu_ms + d_over,
    spend_micros = spend_micros + d_spend WHERE tenant = p_tenant AND minute = v_minute;
  IF FOUND THEN
    RETURN true;
  END IF;
  INSERT INTO fg_usage_minutes (tenant, minute, requests, input_tokens, output_tokens, gpu_ms, overage_gpu_ms,
    spend_micros) VALUES (p_tenant, v_minute, p_requests, d_in, d_out, d_gpu, d_over, d_spend)
  ON CONFLICT (tenant, minute) DO UPDATE SET requests = fg_usage_minutes.requests + excluded.requests,
    input_tokens = fg_usage_minutes.input_tokens + excluded.input_tokens,
    output_tokens = fg_usage_minutes.output_tokens + excluded.output_tokens,
    gpu_ms = fg_usage_minutes.gpu_ms + excluded.gpu_ms,
    overage_gpu_ms = fg_usage_minutes.overage_gpu_ms + excluded.overage_gpu_ms,
    spend_micros = fg_usage_minutes.spend_micros + excluded.spend_micros;
  RETURN true;
END $$;
-- ;;
CREATE OR REPLACE FUNCTION fg_run(p_tenant text, p_run_id text) RETURNS fg_runs LANGUAGE plpgsql STABLE AS $$
DECLARE
  v_run fg_runs;
BEGIN
  SELECT * INTO v_run FROM fg_runs WHERE tenant = p_tenant AND run_id = p_run_id;
  IF NOT FOUND THEN
    v_run.tenant := p_tenant;
    v_run.run_id := p_run_id;
    v_run.model_calls := 0;
    v_run.tool_rounds := 0;
    v_run.tokens := 0;
  END IF;
  RETURN v_run;
END $$;
-- ;;
CREATE OR REPLACE FUNCTION fg_save_run(v_run fg_runs) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO fg_runs (tenant, run_id, model_calls, tool_rounds, tokens)
  VALUES (v_run.tenant, v_run.run_id, v_run.model_calls, v_run.tool_rounds, v_run.tokens)
  ON CONFLICT (tenant, run_id) DO UPDATE SET model_calls = excluded.model_calls,
    tool_rounds = excluded.tool_rounds, tokens = excluded.tokens;
  RETURN true;
END $$;
-- ;;
-- The ledger clock: the caller's fixed clock, else the server's.
CREATE OR REPLACE FUNCTION fg_now(p_now float8) RETURNS float8 LANGUAGE sql VOLATILE AS $$
  SELECT coalesce(p_now, (extract(epoch FROM clock_timestamp()) * 1000)::float8)
$$;
-- ;;
-- rules._check_size_and_rates on one refreshed account (again: a re-open, its request counted already).
CREATE OR REPLACE FUNCTION fg_check_rates(
  a fg_accounts, lim float8[], o integer, account_key text, again boolean, p_in bigint, p_out bigint) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
  v_rate float8;
  v_level float8;
  v_need bigint;
  v_dimension text;
BEGIN
  IF lim[o + 7] IS NOT NULL AND (p_in + p_out)::float8 > lim[o + 7] THEN
    PERFORM fg_refuse('max_tokens_per_request', NULL, 0, account_key);
  END IF;
  IF lim[o + 1] IS NOT NULL AND NOT again AND a.requests_level < 1.0::float8 THEN
    PERFORM fg_refuse('requests_per_minute',
      greatest(0.0::float8, (1.0::float8 - a.requests_level) / lim[o + 1] * 60.0::float8), a.requests_level,
      account_key);
  END IF;
  FOR j IN 0..1 LOOP
    v_rate := lim[o + 2 + j];
    CONTINUE WHEN v_rate IS NULL;
    v_level := CASE WHEN j = 0 THEN a.input_level ELSE a.output_level END;
    v_need := CASE WHEN j = 0 THEN p_in ELSE p_out END;
    v_dimension := CASE WHEN j = 0 THEN 'input_tokens_per_minute' ELSE 'output_tokens_per_minute' END;
    IF v_need::float8 > coalesce(lim[o + 5 + j], 0.0) THEN
      PERFORM fg_refuse(v_dimension, NULL, v_level, account_key);
    END IF;
    IF v_level < v_need::float8 THEN
      PERFORM fg_refuse(v_dimension, greatest(0.0::float8, (v_need::float8 - v_level) / v_rate * 60.0::float8),
        v_level, account_key);
    END IF;
  END LOOP;
  RETURN true;
END $$;
-- ;;
-- rules._check_gpu, then rules._check_spend, on one refreshed account.
CREATE OR REPLACE FUNCTION fg_check_budgets(
  a fg_accounts, lim float8[], o integer, account_key text, estimate float8, spend float8, now_ms float8,
  which integer) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
  v_budget float8;
  v_retry float8;
BEGIN
  IF which = 1 THEN
    v_budget := lim[o + 10];
    IF v_budget IS NOT NULL AND NOT a.gpu_window_used_ms + estimate <= v_budget * 1000.0::float8 THEN
      IF estimate <= v_budget * 1000.0::float8 THEN
        v_retry := greatest(0.0::float8,
          (a.gpu_window_start_ms + lim[o + 11] * 1000.0::float8 - now_ms) / 1000.0::float8);
      END IF;
      PERFORM fg_refuse('gpu_seconds', v_retry,
        greatest(0.0::float8, v_budget - a.gpu_window_used_ms / 1000.0::float8), account_key);
    END IF;
    v_budget := lim[o + 12];
    IF v_budget IS NOT NULL AND NOT a.gpu_total_used_ms + estimate <= v_budget * 1000.0::float8 THEN
      PERFORM fg_refuse('gpu_seconds_total', NULL,
        greatest(0.0::float8, v_budget - a.gpu_total_used_ms / 1000.0::float8), account_key);
    END IF;
    RETURN true;
  END IF;
  v_budget := lim[o + 17];
  -- 1e-3: rules.SPEND_SLACK_MICROS
  IF v_budget IS NULL OR a.spend_used_micros + spend <= v_budget * 1e6::float8 + 1e-3::float8 THEN
    RETURN true;
  END IF;
  IF spend <= v_budget * 1e6::float8 THEN
    v_retry := greatest(0.0::float8,
      (fg_period_start(a.spend_period_start_ms, coalesce(lim[o + 18], 2), true) - now_ms) / 1000.0::float8);
  END IF;
  PERFORM fg_refuse('spend_budget', v_retry, greatest(0.0::float8, v_budget - a.spend_used_micros / 1e6::float8),
    account_key);
  RETURN true;
END $$;
-- ;;
-- rules._counted_run: the run's counters with this call counted (again: its tokens only); c is the offset of
-- the class's book (run limits are the class's).
CREATE OR REPLACE FUNCTION fg_counted_run(
  v_run fg_runs, lim float8[], c integer, account_key text, again boolean, tool_round boolean, tokens bigint)
RETURNS fg_runs LANGUAGE plpgsql AS $$
BEGIN
  IF NOT again AND lim[c + 13] IS NOT NULL AND (v_run.model_calls + 1)::float8 > lim[c + 13] THEN
    PERFORM fg_refuse('max_model_calls', NULL, 0, account_key);
  END IF;
  IF NOT again AND tool_round AND lim[c + 14] IS NOT NULL AND (v_run.tool_rounds + 1)::float8 > lim[c + 14] THEN
    PERFORM fg_refuse('max_tool_rounds', NULL, 0, account_key);
  END IF;
  IF lim[c + 15] IS NOT NULL AND (v_run.tokens + tokens)::float8 > lim[c + 15] THEN
    PERFORM fg_refuse('max_tokens', NULL, greatest(0.0::float8, lim[c + 15] - v_run.tokens::float8), account_key);
  END IF;
  IF NOT again THEN
    v_run.model_calls := v_run.model_calls + 1;
    v_run.tool_rounds := v_run.tool_rounds + CASE WHEN tool_round THEN 1 ELSE 0 END;
  END IF;
  v_run.tokens := v_run.tokens + tokens;
  RETURN v_run;
END $$;
-- ;;
-- rules.reserve's checks before the run's: p_tenant's accounts of p_keys refreshed to now_ms, then each check on
-- every account in turn; the accounts as refreshed, or a refusal (FG001).
CREATE OR REPLACE FUNCTION fg_checked_accounts(
  p_tenant text, p_keys text[], p_limits float8[], now_ms float8, again boolean, p_in bigint, p_out bigint,
  p_estimate float8, p_spend float8) RETURNS fg_accounts[]
LANGUAGE plpgsql AS $$
DECLARE
  v_ok boolean;
  v_n integer := array_length(p_keys, 1);
  v_accs fg_accounts[] := '{}';
BEGIN
  FOR i IN 1..v_n LOOP
    v_accs[i] := fg_refreshed(fg_account(p_tenant, p_keys[i]), p_limits, (i - 1) * 18, now_ms);
  END LOOP;
  FOR i IN 1..v_n LOOP
    v_ok := fg_check_rates(v_accs[i], p_limits, (i - 1) * 18, p_keys[i], again, p_in, p_out);
  END LOOP;
  FOR i IN 1..v_n LOOP
    IF p_limits[(i - 1) * 18 + 8] IS NOT NULL AND (v_accs[i]).concurrent::float8 >= p_limits[(i - 1) * 18 + 8] THEN
      PERFORM fg_refuse('max_concurrent', 1.0, 0, p_keys[i]);  -- 1.0: rules.CONCURRENCY_RETRY_S
    END IF;
  END LOOP;
  FOR which IN 1..2 LOOP
    FOR i IN 1..v_n LOOP
      v_ok := fg_check_budgets(v_accs[i], p_limits, (i - 1) * 18, p_keys[i], p_estimate, p_spend, now_ms, which);
    END LOOP;
  END LOOP;
  RETURN v_accs;
END $$;
-- ;;
-- rules.claim on open reservation p_id at now_ms: the run claim taken or renewed for p_owner for p_lease_ms (with
-- a heartbeat), or its holder's unchanged. p_free: no claim can be held on it (this call made or re-opened it).
CREATE OR REPLACE FUNCTION fg_take_claim(
  p_id text, p_owner text, p_lease_ms float8, now_ms float8, p_free boolean,
  OUT holder text, OUT lease_until_ms float8)
LANGUAGE plpgsql AS $$
DECLARE
  v_owner text;
  v_until float8;
BEGIN
  IF NOT p_free THEN
    SELECT c.owner, c.until_ms INTO v_owner, v_until FROM fg_claims c WHERE c.reservation_id = p_id;
    IF FOUND AND v_owner <> p_owner AND v_until > now_ms THEN
      holder := v_owner;
      lease_until_ms := v_until;
      RETURN;
    END IF;
  END IF;
  holder := p_owner;
  lease_until_ms := now_ms + p_lease_ms;
  IF p_free THEN  -- no row to meet: plain inserts, without an upsert's conflict check
    INSERT INTO fg_claims (reservation_id, owner, until_ms) VALUES (p_id, p_owner, lease_until_ms);
    INSERT INTO fg_heartbeats (reservation_id, beat_ms) VALUES (p_id, now_ms);
    RETURN;
  END IF;
  INSERT INTO fg_claims AS c (reservation_id, owner, until_ms) VALUES (p_id, p_owner, lease_until_ms)
    ON CONFLICT (reservation_id) DO UPDATE SET owner = excluded.owner, until_ms = excluded.until_ms;
  INSERT INTO fg_heartbeats AS h (reservation_id, beat_ms) VALUES (p_id, now_ms)
    ON CONFLICT (reservation_id) DO UPDATE SET beat_ms = excluded.beat_ms;
END $$;
-- ;;
-- rules.check_retry's fingerprint: whether reservation r was made with these arguments.
CREATE OR REPLACE FUNCTION fg_same_args(
  r fg_reservations, p_in bigint, p_out bigint, p_estimate float8, p_model_class text, p_run_id text,
  p_tool_round boolean) RETURNS boolean LANGUAGE sql IMMUTABLE AS $$
  SELECT r.input_tokens = p_in AND r.max_output_tokens = p_out AND r.gpu_ms_estimate = p_estimate
    AND r.model_class = p_model_class AND r.run_id IS NOT DISTINCT FROM p_run_id AND (r.tool_round <> 0) = p_tool_round
$$;
-- ;;
-- rules.reserve's deductions on one checked account (again: a re-open, its request counted already).
CREATE OR REPLACE FUNCTION fg_charged(
  a fg_accounts, again boolean, p_in bigint, p_out bigint, p_estimate float8, p_spend float8) RETURNS fg_accounts
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
  IF a.requests_level IS NOT NULL AND NOT again THEN
    a.requests_level := a.requests_level - 1.0::float8;
  END IF;
  IF a.input_level IS NOT NULL THEN
    a.input_level := a.input_level - p_in::float8;
  END IF;
  IF a.output_level IS NOT NULL THEN
    a.output_level := a.output_level - p_out::float8;
  END IF;
  a.concurrent := a.concurrent + 1;
  a.gpu_window_used_ms := a.gpu_window_used_ms + p_estimate;
  a.gpu_total_used_ms := a.gpu_total_used_ms + p_estimate;
  a.spend_used_micros := a.spend_used_micros + p_spend;
  RETURN a;
END $$;
-- ;;
-- rules.reserve with the retry rules (check_retry, reopens, reopened): the reservation made or re-opened
-- ('ok'), or the request id's earlier one returned as it is ('existing': the caller checks its arguments),
-- with the binding account (the last book's) as written, or as stored for 'existing'. With p_owner, then
-- rules.claim_on_reserve: the run claim of an open reservation (holder, lease_until_ms at clock_ms; NULL on a
-- final one), on 'existing' only when its arguments are the same (else the caller raises IdempotencyConflict:
-- nothing is written).
CREATE OR REPLACE FUNCTION fg_reserve(
  p_lock bigint, p_now float8, p_id text, p_tenant text, p_request_id text, p_model_class text, p_run_id text,
  p_tool_round boolean, p_in bigint, p_out bigint, p_estimate float8, p_price float8[], p_ttl_s float8,
  p_keys text[], p_limits float8[], p_owner text, p_lease_ms float8, OUT code text, OUT res fg_reservations,
  OUT bal fg_accounts, OUT holder text, OUT lease_until_ms float8, OUT clock_ms float8)
LANGUAGE plpgsql AS $$
DECLARE
  v_locked text;  -- pg_advisory_xact_lock returns void
  v_ok boolean;
  v_r fg_reservations;
  v_accs fg_accounts[];
  v_n integer := array_length(p_keys, 1);
  v_same boolean;
  v_again boolean := false;
  v_spend float8 := fg_spend(p_price[1], p_price[2], p_price[3], p_in, p_out, p_estimate);
  v_run fg_runs;
  v_claim record;
BEGIN
  v_locked := pg_advisory_xact_lock(p_lock);
  SELECT * INTO v_r FROM fg_reservations WHERE tenant = p_tenant AND request_id = p_request_id;
  IF FOUND THEN
    v_same := fg_same_args(v_r, p_in, p_out, p_estimate, p_model_class, p_run_id, p_tool_round);
    IF NOT (v_r.status = 'cancelled' AND v_r.billed_input_tokens = 0 AND v_r.billed_output_tokens = 0
        AND v_r.billed_gpu_ms = 0 AND v_same) THEN
      code := 'existing';
      res := v_r;
      SELECT * INTO bal FROM fg_accounts WHERE tenant = p_tenant AND model_class = p_keys[v_n];
      IF p_owner IS NOT NULL AND v_r.status = 'open' AND v_same THEN
        clock_ms := fg_now(p_now);
        v_claim := fg_take_claim(v_r.id, p_owner, p_lease_ms, clock_ms, false);
        holder := v_claim.holder;
        lease_until_ms := v_claim.lease_until_ms;
      END IF;
      RETURN;
    END IF;
    v_again := true;
  END IF;
  clock_ms := fg_now(p_now);
  v_accs := fg_checked_accounts(p_tenant, p_keys, p_limits, clock_ms, v_again, p_in, p_out, p_estimate, v_spend);
  IF p_run_id IS NOT NULL THEN
    v_run := fg_counted_run(fg_run(p_tenant, p_run_id), p_limits, (v_n - 1) * 18, p_keys[v_n], v_again,
      p_tool_round, p_in + p_out);
  END IF;
  IF v_again THEN  -- rules.reopened: same id and creation time, nothing billed, a new TTL, the price now
    UPDATE fg_reservations SET status = 'open', billed_input_tokens = 0, billed_output_tokens = 0,
      billed_gpu_ms = 0.0, overage_gpu_ms = 0.0, expires_at_ms = clock_ms + p_ttl_s * 1000.0::float8,
      final_ms = NULL, queued = 0, price_input_micros = p_price[1], price_output_micros = p_price[2],
      price_gpu_micros = p_price[3] WHERE id = v_r.id RETURNING * INTO v_r;
    DELETE FROM fg_heartbeats WHERE reservation_id = v_r.id;  -- the order of the sweep's deletes
    DELETE FROM fg_claims WHERE reservation_id = v_r.id;
  ELSE
    INSERT INTO fg_reservations (id, tenant, request_id, model_class, run_id, tool_round, input_tokens,
      max_output_tokens, gpu_ms_estimate, status, billed_input_tokens, billed_output_tokens, billed_gpu_ms,
      overage_gpu_ms, created_ms, expires_at_ms, final_ms, queued, price_input_micros, price_output_micros,
      price_gpu_micros)
    VALUES (p_id, p_tenant, p_request_id, p_model_class, p_run_id, p_tool_round::integer, p_in, p_out, p_estimate,
      'open', 0, 0, 0.0, 0.0, clock_ms, clock_ms + p_ttl_s * 1000.0::float8, NULL, 0, p_price[1], p_price[2],
      p_price[3]) RETURNING * INTO v_r;
  END IF;
  FOR i IN 1..v_n LOOP
    bal := fg_charged(v_accs[i], v_again, p_in, p_out, p_estimate, v_spend);
    v_ok := fg_save_account(bal);
  END LOOP;
  v_ok := fg_add_event(p_tenant, v_r.id, 'reserve', CASE WHEN v_again THEN 0 ELSE 1 END, 0, 0, 0.0, 0.0, 0.0,
    clock_ms);
  IF p_run_id IS NOT NULL THEN
    v_ok := fg_save_run(v_run);
  END IF;
  code := 'ok';
  res := v_r;
  IF p_owner IS NOT NULL THEN  -- nobody holds a claim on a reservation this call made or re-opened
    v_claim := fg_take_claim(v_r.id, p_owner, p_lease_ms, clock_ms, true);
    holder := v_claim.holder;
    lease_until_ms := v_claim.lease_until_ms;
  END IF;
END $$;
-- ;;
-- The books of a reservation of p_tenant in model_class, from all of p_tenant's (p_keys: '*', then every
-- class with limits of its own): TenantQuota.accounts.
CREATE OR REPLACE FUNCTION fg_books(
  model_class text, p_keys text[], p_limits float8[], OUT keys text[], OUT lim float8[])
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
  v_i integer := array_position(p_keys, model_class);
BEGIN
  keys := ARRAY[p_keys[1]];
  lim := p_limits[1:18];
  IF v_i IS NOT NULL AND v_i > 1 THEN
    keys := keys || model_class;
    lim := lim || p_limits[(v_i - 1) * 18 + 1:v_i * 18];
  END IF;
END $$;
-- ;;
-- rules.settle's account step (_settled_account, _used_after) on one refreshed account.
CREATE OR REPLACE FUNCTION fg_settled_account(
  a fg_accounts, lim float8[], o integer, r fg_reservations, returned_in bigint, returned_out bigint,
  old_gpu float8, new_gpu float8, spend_change float8, is_final boolean) RETURNS fg_accounts
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
  gpu_change float8 := new_gpu - old_gpu;
BEGIN
  IF a.input_level IS NOT NULL AND returned_in <> 0 THEN
    a.input_level := least(coalesce(lim[o + 5], 0.0), a.input_level + returned_in::float8);
  END IF;
  IF a.output_level IS NOT NULL AND returned_out <> 0 THEN
    a.output_level := least(coalesce(lim[o + 6], 0.0), a.output_level + returned_out::float8);
  END IF;
  -- rules._used_after: a reservation made before the window or period began keeps its hold there
  IF r.created_ms < a.gpu_window_start_ms THEN
    a.gpu_window_used_ms := a.gpu_window_used_ms + greatest(0.0::float8, gpu_change);
  ELSE
    a.gpu_window_used_ms := greatest(0.0::float8, a.gpu_window_used_ms + gpu_change);
  END IF;
  -- (used + new) - old, as rules.settle adds them: another order rounds differently at a budget's edge
  a.gpu_total_used_ms := greatest(0.0::float8, a.gpu_total_used_ms + new_gpu - old_gpu);
  IF r.created_ms < a.spend_period_start_ms THEN
    a.spend_used_micros := a.spend_used_micros + greatest(0.0::float8, spend_change);
  ELSE
    a.spend_used_micros := greatest(0.0::float8, a.spend_used_micros + spend_change);
  END IF;
  IF is_final THEN
    a.concurrent := greatest(0, a.concurrent - 1);
    IF r.queued <> 0 THEN
      a.queued := greatest(0, a.queued - 1);
    END IF;
  END IF;
  RETURN a;
END $$;
-- ;;
-- rules.settle's writes, for fg_close: reservation r (open, as read) billed b_in, b_out and b_gpu, closed
-- (p_final) as p_kind says; its books' accounts (keys, lim) refreshed to now_ms and charged or given back, its
-- event and its run's tokens. The reservation as written.
CREATE OR REPLACE FUNCTION fg_close_writes(
  r fg_reservations, p_kind text, p_final boolean, b_in bigint, b_out bigint, b_gpu float8, now_ms float8,
  keys text[], lim float8[]) RETURNS fg_reservations
LANGUAGE plpgsql AS $$
DECLARE
  v_ok boolean;
  v_res fg_reservations;
  v_old_in bigint;
  v_old_gpu float8;
  v_new_in bigint;
  v_new_out bigint;
  v_new_gpu float8;
  v_spend_change float8;
  v_run fg_runs;
  v_overage float8;
  v_status text := 'open';
  v_kind text := 'settle';
BEGIN
  -- rules._held: before, and after this call
  v_old_in := greatest(r.input_tokens, r.billed_input_tokens);
  v_old_gpu := greatest(r.gpu_ms_estimate, r.billed_gpu_ms);
  IF p_final THEN
    v_new_in := b_in;
    v_new_out := b_out;
    v_new_gpu := b_gpu;
  ELSE
    v_new_in := greatest(r.input_tokens, b_in);
    v_new_out := r.max_output_tokens;
    v_new_gpu := greatest(r.gpu_ms_estimate, b_gpu);
  END IF;
  v_spend_change := fg_spend(r.price_input_micros, r.price_output_micros, r.price_gpu_micros, v_new_in, v_new_out,
      v_new_gpu)
    - fg_spend(r.price_input_micros, r.price_output_micros, r.price_gpu_micros, v_old_in, r.max_output_tokens,
      v_old_gpu);
  v_overage := greatest(0.0::float8, b_gpu - r.gpu_ms_estimate);
  IF p_final THEN
    v_status := CASE p_kind WHEN 'settle' THEN 'settled' WHEN 'cancel' THEN 'cancelled' ELSE 'expired' END;
    v_kind := CASE p_kind WHEN 'settle' THEN 'settle_final' ELSE p_kind END;
  END IF;
  UPDATE fg_reservations SET status = v_status, billed_input_tokens = b_in, billed_output_tokens = b_out,
    billed_gpu_ms = b_gpu, overage_gpu_ms = v_overage, final_ms = CASE WHEN p_final THEN now_ms END,
    queued = CASE WHEN p_final THEN 0 ELSE queued END
    WHERE id = r.id RETURNING * INTO v_res;
  FOR i IN 1..array_length(keys, 1) LOOP
    v_ok := fg_save_account(fg_settled_account(
      fg_refreshed(fg_account(r.tenant, keys[i]), lim, (i - 1) * 18, now_ms), lim, (i - 1) * 18, r,
      v_old_in - v_new_in, r.max_output_tokens - v_new_out, v_old_gpu, v_new_gpu, v_spend_change, p_final));
  END LOOP;
  v_ok := fg_add_event(r.tenant, r.id, v_kind, 0, b_in - r.billed_input_tokens,
    b_out - r.billed_output_tokens, b_gpu - r.billed_gpu_ms, v_overage - r.overage_gpu_ms,
    fg_spend(r.price_input_micros, r.price_output_micros, r.price_gpu_micros, b_in, b_out, b_gpu)
      - fg_spend(r.price_input_micros, r.price_output_micros, r.price_gpu_micros, r.billed_input_tokens,
        r.billed_output_tokens, r.billed_gpu_ms),
    now_ms);
  IF r.run_id IS NOT NULL THEN
    v_run := fg_run(r.tenant, r.run_id);
    v_run.tokens := greatest(0, v_run.tokens + (v_new_in + v_new_out) - (v_old_in + r.max_output_tokens));
    v_ok := fg_save_run(v_run);
  END IF;
  RETURN v_res;
END $$;
-- ;;
-- rules.settle (settle, cancel, expire; p_in NULL: what the reservation has billed, as the sweep's expiry
-- bills). 'ok', 'unchanged' (a repeated partial settlement) or 'final' (closed already: the caller applies
-- rules.check_final_again). p_tenant is the configured tenant the id's tag names (NULL: none); a reservation
-- of another is its tenant-wide account with p_fallback's limits for an expiry (Ledger.closing_books) and
-- an unknown tenant otherwise.
CREATE OR REPLACE FUNCTION fg_close(
  p_lock bigint, p_now float8, p_id text, p_kind text, p_final boolean, p_in bigint, p_out bigint, p_gpu float8,
  p_tenant text, p_keys text[], p_limits float8[], p_fallback float8[], OUT code text, OUT res fg_reservations)
LANGUAGE plpgsql AS $$
DECLARE
  v_locked text;  -- pg_advisory_xact_lock returns void
  v_books record;
  v_read record;
  r fg_reservations;
  v_b_in bigint;
  v_b_out bigint;
  v_b_gpu float8;
  v_now float8;
  v_keys text[] := ARRAY['*'];
  v_lim float8[] := p_fallback;
BEGIN
  v_locked := pg_advisory_xact_lock(p_lock);
  -- the frozen flag read in the same statement: one executor start and end less per call
  SELECT x AS res, EXISTS (SELECT 1 FROM fg_frozen f WHERE f.tenant = x.tenant) AS frozen INTO v_read
    FROM fg_reservations x WHERE x.id = p_id;
  IF NOT FOUND THEN
    RAISE EXCEPTION USING ERRCODE = 'FG002', MESSAGE = 'no such reservation';
  END IF;
  r := v_read.res;
  v_b_in := coalesce(p_in, r.billed_input_tokens);
  v_b_out := coalesce(p_out, r.billed_output_tokens);
  v_b_gpu := coalesce(p_gpu, r.billed_gpu_ms);
  IF r.status <> 'open' THEN
    code := 'final';
    res := r;
    RETURN;
  END IF;
  IF v_read.frozen THEN
    RAISE EXCEPTION USING ERRCODE = 'FG003', MESSAGE = 'settlement frozen', DETAIL = r.tenant;
  END IF;
  IF NOT p_final AND v_b_in = r.billed_input_tokens AND v_b_out = r.billed_output_tokens
      AND v_b_gpu = r.billed_gpu_ms THEN
    code := 'unchanged';
    res := r;
    RETURN;
  END IF;
  v_now := fg_now(p_now);
  IF r.tenant IS DISTINCT FROM p_tenant THEN
    IF p_kind <> 'expire' THEN
      RAISE EXCEPTION USING ERRCODE = 'FG006', MESSAGE = 'unknown tenant', DETAIL = r.tenant;
    END IF;
  ELSIF array_length(p_keys, 1) = 1 THEN  -- the tenant-wide book alone: fg_books' answer, without its call
    v_keys := p_keys;
    v_lim := p_limits;
  ELSE
    v_books := fg_books(r.model_class, p_keys, p_limits);
    v_keys := v_books.keys;
    v_lim := v_books.lim;
  END IF;
  -- rules.check_billing
  IF v_b_out > r.max_output_tokens OR v_b_in < r.billed_input_tokens OR v_b_out < r.billed_output_tokens
      OR v_b_gpu < r.billed_gpu_ms THEN
    RAISE EXCEPTION USING ERRCODE = 'FG004', MESSAGE = 'amounts do not fit the reservation',
      DETAIL = r.max_output_tokens || ' ' || r.billed_input_tokens || ' ' || r.billed_output_tokens || ' '
        || encode(float8send(r.billed_gpu_ms), 'hex');
  END IF;
  res := fg_close_writes(r, p_kind, p_final, v_b_in, v_b_out, v_b_gpu, v_now, v_keys, v_lim);
  code := 'ok';
END $$;
-- ;;
-- rules.claim: the run claim taken or renewed for p_owner (with a heartbeat), or its holder's unchanged.
CREATE OR REPLACE FUNCTION fg_claim(
  p_lock bigint, p_now float8, p_id text, p_owner text, p_lease_ms float8,
  OUT holder text, OUT lease_until_ms float8, OUT clock_ms float8)
LANGUAGE plpgsql AS $$
DECLARE
  v_locked text;  -- pg_advisory_xact_lock returns void
  v_status text;
  v_claim record;
BEGIN
  v_locked := pg_advisory_xact_lock(p_lock);
  SELECT status INTO v_status FROM fg_reservations WHERE id = p_id;
  IF NOT FOUND THEN
    RAISE EXCEPTION USING ERRCODE = 'FG002', MESSAGE = 'no such reservation';
  END IF;
  IF v_status <> 'open' THEN
    RAISE EXCEPTION USING ERRCODE = 'FG005', MESSAGE = 'reservation final already', DETAIL = v_status;
  END IF;
  clock_ms := fg_now(p_now);
  v_claim := fg_take_claim(p_id, p_owner, p_lease_ms, clock_ms, false);
  holder := v_claim.holder;
  lease_until_ms := v_claim.lease_until_ms;
END $$;
-- ;;
-- rules.enqueue (p_enter) / rules.dequeue: 'ok', or 'unchanged' (nothing to do). The accounts are not
-- refreshed (no clock): a queue place is a count. p_tenant, p_keys, p_limits as fg_close's.
CREATE OR REPLACE FUNCTION fg_queue_step(
  p_lock bigint, p_id text, p_enter boolean, p_tenant text, p_keys text[], p_limits float8[],
  OUT code text, OUT res fg_reservations)
LANGUAGE plpgsql AS $$
DECLARE
  v_locked text;  -- pg_advisory_xact_lock returns void
  v_ok boolean;
  v_books record;
  r fg_reservations;
  v_keys text[] := ARRAY['*'];
  v_lim float8[];
  v_a fg_accounts;
  v_accs fg_accounts[] := '{}';
BEGIN
  v_locked := pg_advisory_xact_lock(p_lock);
  SELECT * INTO r FROM fg_reservations WHERE id = p_id;
  IF NOT FOUND THEN
    RAISE EXCEPTION USING ERRCODE = 'FG002', MESSAGE = 'no such reservation';
  END IF;
  IF r.tenant IS DISTINCT FROM p_tenant THEN
    IF p_enter THEN
      RAISE EXCEPTION USING ERRCODE = 'FG006', MESSAGE = 'unknown tenant', DETAIL = r.tenant;
    END IF;
  ELSE
    v_books := fg_books(r.model_class, p_keys, p_limits);
    v_keys := v_books.keys;
    v_lim := v_books.lim;
  END IF;
  IF r.status <> 'open' OR (r.queued <> 0) = p_enter THEN
    code := 'unchanged';
    res := r;
    RETURN;
  END IF;
  FOR i IN 1..array_length(v_keys, 1) LOOP
    v_accs[i] := fg_account(r.tenant, v_keys[i]);
    IF p_enter AND v_lim[(i - 1) * 18 + 9] IS NOT NULL
        AND (v_accs[i]).queued::float8 >= v_lim[(i - 1) * 18 + 9] THEN
      PERFORM fg_refuse('max_queued', 2.0, 0, v_keys[i]);  -- 2.0: rules.QUEUE_RETRY_S
    END IF;
  END LOOP;
  UPDATE fg_reservations SET queued = CASE WHEN p_enter THEN 1 ELSE 0 END WHERE id = p_id RETURNING * INTO res;
  FOR i IN 1..array_length(v_keys, 1) LOOP
    v_a := v_accs[i];
    v_a.queued := CASE WHEN p_enter THEN v_a.queued + 1 ELSE greatest(0, v_a.queued - 1) END;
    v_ok := fg_save_account(v_a);
  END LOOP;
  code := 'ok';
END $$;
-- ;;
-- The request path's calls as a batch runs them (postgres_batch.py: several calls of one process in one
-- transaction, one commit): each call in a subtransaction of its own (the EXCEPTION block), so that a refusal
-- rolls back only what that call wrote and the others commit. The error comes back as columns (err_state NULL:
-- none), the call's own OUT columns after them.
CREATE OR REPLACE FUNCTION fg_try_reserve(
  p_lock bigint, p_now float8, p_id text, p_tenant text, p_request_id text, p_model_class text, p_run_id text,
  p_tool_round boolean, p_in bigint, p_out bigint, p_estimate float8, p_price float8[], p_ttl_s float8,
  p_keys text[], p_limits float8[], p_owner text, p_lease_ms float8, OUT err_state text, OUT err_message text,
  OUT err_detail text, OUT code text, OUT res fg_reservations, OUT bal fg_accounts, OUT holder text,
  OUT lease_until_ms float8, OUT clock_ms float8)
LANGUAGE plpgsql AS $$
DECLARE
  v record;
BEGIN
  v := fg_reserve(p_lock, p_now, p_id, p_tenant, p_request_id, p_model_class, p_run_id, p_tool_round, p_in, p_out,
    p_estimate, p_price, p_ttl_s, p_keys, p_limits, p_owner, p_lease_ms);
  code := v.code;
  res := v.res;
  bal := v.bal;
  holder := v.holder;
  lease_until_ms := v.lease_until_ms;
  clock_ms := v.clock_ms;
EXCEPTION WHEN others THEN
  GET STACKED DIAGNOSTICS err_state = RETURNED_SQLSTATE, err_message = MESSAGE_TEXT, err_detail = PG_EXCEPTION_DETAIL;
END $$;
-- ;;
CREATE OR REPLACE FUNCTION fg_try_close(
  p_lock bigint, p_now float8, p_id text, p_kind text, p_final boolean, p_in bigint, p_out bigint, p_gpu float8,
  p_tenant text, p_keys text[], p_limits float8[], p_fallback float8[], OUT err_state text, OUT err_message text,
  OUT err_detail text, OUT code text, OUT res fg_reservations)
LANGUAGE plpgsql AS $$
DECLARE
  v record;
BEGIN
  v := fg_close(p_lock, p_now, p_id, p_kind, p_final, p_in, p_out, p_gpu, p_tenant, p_keys, p_limits, p_fallback);
  code := v.code;
  res := v.res;
EXCEPTION WHEN others THEN
  GET STACKED DIAGNOSTICS err_state = RETURNED_SQLSTATE, err_message = MESSAGE_TEXT, err_detail = PG_EXCEPTION_DETAIL;
END $$;
-- ;;
CREATE OR REPLACE FUNCTION fg_try_claim(
  p_lock bigint, p_now float8, p_id text, p_owner text, p_lease_ms float8, OUT err_state text,
  OUT err_message text, OUT err_detail text, OUT holder text, OUT lease_until_ms float8, OUT clock_ms float8)
LANGUAGE plpgsql AS $$
DECLARE
  v record;
BEGIN
  v := fg_claim(p_lock, p_now, p_id, p_owner, p_lease_ms);
  holder := v.holder;
  lease_until_ms := v.lease_until_ms;
  clock_ms := v.clock_ms;
EXCEPTION WHEN others THEN
  GET STACKED DIAGNOSTICS err_state = RETURNED_SQLSTATE, err_message = MESSAGE_TEXT, err_detail = PG_EXCEPTION_DETAIL;
END $$;
-- ;;
CREATE OR REPLACE FUNCTION fg_try_queue_step(
  p_lock bigint, p_id text, p_enter boolean, p_tenant text, p_keys text[], p_limits float8[], OUT err_state text,
  OUT err_message text, OUT err_detail text, OUT code text, OUT res fg_reservations)
LANGUAGE plpgsql AS $$
DECLARE
  v record;
BEGIN
  v := fg_queue_step(p_lock, p_id, p_enter, p_tenant, p_keys, p_limits);
  code := v.code;
  res := v.res;
EXCEPTION WHEN others THEN
  GET STACKED DIAGNOSTICS err_state = RETURNED_SQLSTATE, err_message = MESSAGE_TEXT, err_detail = PG_EXCEPTION_DETAIL;
END $$;
