-- Token-bucket arithmetic: fairgate/core/ratelimit.py's refill, wait and credit, operation for operation
-- and in the same order (Lua numbers are IEEE doubles like Python floats, so both give the same bits).
-- tests/core/test_ratelimit.py runs this file against the same table of cases as the Python.

-- The bucket brought up to now_ms: level, updated_ms. A nil level is a new bucket, full at now_ms.
local function bucket_refill(level, updated_ms, now_ms, rate, burst, per_ms)
  if level == nil then return burst, now_ms end
  local elapsed = math.max(0.0, now_ms - updated_ms)
  return math.min(burst, level + elapsed * rate / per_ms), math.max(updated_ms, now_ms)
end

-- How long until the bucket holds need units, refilled at rate units every per (in the unit of per).
local function bucket_wait(level, need, rate, per) return math.max(0.0, (need - level) / rate * per) end

-- The level after giving back units (negative: taking them), capped at burst.
local function bucket_credit(level, units, burst) return math.min(burst, level + units) end
