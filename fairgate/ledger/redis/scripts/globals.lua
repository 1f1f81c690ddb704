-- The globals the scripts use, and the functions of theirs they call, as locals of the library (this file comes
-- first: lua.py). Run as a function, a script reads a global through the __index of an empty globals table (a
-- missed read, the metamethod's lookup, then the real globals' read), then the function from its table, where
-- a library local is one step. A function library's globals are its load-time API until one of its functions
-- is called, so bind_globals (called by prelude.lua's bind) sets them at the first call; register_function
-- reads the load-time `redis`, for the library's registrations. bucket.lua, which also runs alone
-- (tests/core/test_ratelimit.py), keeps math.*.
local function register_function(name, fn) return redis.register_function(name, fn) end
local function runtime_globals() return redis, cjson, struct, math, string, tonumber, ipairs end
local redis, cjson, struct, math, string, tonumber, ipairs
local call, max, min, floor, ceil, fmod, format, find, sub, json_encode, json_decode
local function bind_globals()
  if redis ~= nil then return end
  redis, cjson, struct, math, string, tonumber, ipairs = runtime_globals()
  call, json_encode, json_decode = redis.call, cjson.encode, cjson.decode
  max, min, floor, ceil, fmod = math.max, math.min, math.floor, math.ceil, math.fmod
  format, find, sub = string.format, string.find, string.sub
end
