-- SPDX-License-Identifier: MIT
--
-- The float peer of bench/redis/script-cost: a GCRA limiter in the shape
-- most Redis rate limiters share (go-redis/redis_rate and its copies):
-- TIME, GET of a float "theoretical arrival time", float arithmetic, SET
-- ... EX, a 4-element reply.  Written for the comparison, not for use: it
-- rounds, and a refused call writes nothing.
--
-- KEYS[1] key; ARGV: burst, rate, period (s), cost
local key = KEYS[1]
local burst, rate, period, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local interval = period / rate
local inc = interval * cost
local offset = interval * burst
local t = redis.call("TIME")
local now = (t[1] - 1600000000) + t[2] / 1000000
local tat = redis.call("GET", key)
tat = tat and tonumber(tat) or now
if tat < now then
	tat = now
end
local new_tat = tat + inc
local diff = now - (new_tat - offset)
if diff < 0 then
	return { 0, 0, tostring(-diff), tostring(tat - now) }
end
local reset = new_tat - now
if reset > 0 then
	redis.call("SET", key, new_tat, "EX", math.ceil(reset))
end
return { cost, math.floor(diff / interval), "-1", tostring(reset) }
