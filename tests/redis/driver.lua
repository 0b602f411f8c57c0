-- SPDX-License-Identifier: MIT
--
-- usage: lua5.1 driver.lua SCRIPT < steps
--
-- Runs the bucket script outside Redis, with redis.call reduced to GET, SET
-- and TIME on a table, and checks each step against what the local library
-- answered (tokenbucket-redis-diffgen writes the steps).  A line is
--   key op now tokens period burst n arg | code act tokens
-- code is the reply's code (E: an error reply), act the reservation's
-- time_to_act, both exact; tokens is tokens_at's value, checked to 1e-9
-- relative ("-": not checked).  Exits 1 at the first difference.
local script = assert(loadfile(arg[1]))
local store, errors = {}, 0

local function reply_error(msg)
	return { err = msg }
end
redis = {
	call = function(cmd, k, v, px, ms)
		if cmd == "GET" then
			return store[k] or false
		elseif cmd == "SET" then
			store[k] = v
			return { ok = "OK" }
		elseif cmd == "TIME" then
			return { "1700000000", "0" }
		end
		error("unexpected command " .. tostring(cmd))
	end,
	error_reply = reply_error,
}

local steps, keys = 0, {}
for line in io.lines() do
	local args, want = string.match(line, "^(.-) | (.*)$")
	local f = {}
	for w in string.gmatch(args, "%S+") do
		f[#f + 1] = w
	end
	KEYS = { f[1] }
	ARGV = { f[2], f[3], f[4], f[5], f[6], f[7], f[8] }
	keys[f[1]] = true
	local r = script()
	local wc, wact, wtok = string.match(want, "^(%S+) (%S+) (%S+)$")
	local ok, got
	if r.err then
		got = "error " .. r.err
		ok = wc == "E"
	else
		got = string.format("%d %s", r[1], r[6])
		ok = tostring(r[1]) == wc and (wact == "-" or wact == r[6])
		if ok and wtok ~= "-" then
			-- level + rem / q, clamped to burst, as the library computes it
			local v = tonumber(r[3]) + tonumber(r[4]) / tonumber(r[5])
			local b = tonumber(f[6])
			if v > b then
				v = b
			end
			local w = tonumber(wtok)
			ok = math.abs(v - w) <= 1e-9 * math.max(1, math.abs(w))
			got = got .. " tokens " .. string.format("%.17g", v)
		end
	end
	steps = steps + 1
	if not ok then
		io.stderr:write("difference at step ", steps, ":\n  ", line, "\n  got ", got, "\n")
		os.exit(1)
	end
end
local n = 0
for _ in pairs(keys) do
	n = n + 1
end
print(string.format("lua differential: %d steps in %d sequences, no difference", steps, n))
