-- SPDX-License-Identifier: MIT
--
-- usage: lua5.1 driver.lua SCRIPT [--general] < steps
--
-- Runs the bucket script outside Redis, with redis.call reduced to GET, SET
-- and TIME on a table, and checks each step against what the local library
-- answered (tokenbucket-redis-diffgen writes the steps).  A line is
--   key op now tokens period burst n arg | code act tokens
-- (now "server" asks for the server's clock)
-- code is the reply's code (E: an error reply), act the reservation's
-- time_to_act, both exact; tokens is tokens_at's value, checked to 1e-9
-- relative ("-": not checked).  With --general every step also runs on the
-- script with its common case turned off, on a store of its own, and must
-- give the same reply, the same stored value and the same expiry.  A step
-- at the caller's time must leave the key without an expiry.  Exits 1 at
-- the first difference.
local script = assert(loadfile(arg[1]))
local general
if arg[2] == "--general" then
	local f = assert(io.open(arg[1]))
	local src = f:read("*a")
	f:close()
	local gate = '\nlocal common = op == "allow" or op == "reserve"\n'
	local i, j = string.find(src, gate, 1, true)
	if not i or string.find(src, gate, j, true) then
		io.stderr:write("driver.lua: the common case's gate is not once in ", arg[1], "\n")
		os.exit(1)
	end
	general = assert(loadstring(string.sub(src, 1, i) .. "local common = false\n"
		.. string.sub(src, j + 1), "=general"))
elseif arg[2] then
	io.stderr:write("usage: lua5.1 driver.lua SCRIPT [--general] < steps\n")
	os.exit(2)
end
local stores, store = { {}, {} }, nil
local sets, concats, concat = 0, 0, table.concat
table.concat = function(...)
	concats = concats + 1
	return concat(...)
end

local function reply_error(msg)
	return { err = msg }
end
redis = {
	call = function(cmd, k, v, px, ms)
		if cmd == "GET" then
			return store[k] and store[k].value or false
		elseif cmd == "SET" then
			sets = sets + 1
			store[k] = { value = v, px = px and (px .. " " .. ms) or "" }
			return { ok = "OK" }
		elseif cmd == "TIME" then
			return { "1700000000", "0" }
		end
		error("unexpected command " .. tostring(cmd))
	end,
	error_reply = reply_error,
}

-- A reply and the key's stored value and expiry, as one line.
local function summary(r, k)
	local got = r.err and ("error " .. r.err) or concat(r, " ", 1, 7)
	local st = store[k]
	return got .. " | " .. (st and (st.value .. " " .. st.px) or "nil")
end

local steps, keys, common = 0, {}, 0
for line in io.lines() do
	local args, want = string.match(line, "^(.-) | (.*)$")
	local f = {}
	for w in string.gmatch(args, "%S+") do
		f[#f + 1] = w
	end
	KEYS = { f[1] }
	-- now "server": the server's clock, which the stub's TIME keeps at 1.7e18 ns.
	ARGV = { f[2], f[3] == "server" and "" or f[3], f[4], f[5], f[6], f[7], f[8] }
	keys[f[1]] = true
	store = stores[1]
	-- The common case writes its value with "..", the general path with
	-- table.concat: a step that wrote without table.concat was the former's.
	local sets0, concats0 = sets, concats
	local r = script()
	if sets > sets0 and concats == concats0 then
		common = common + 1
	end
	if general then
		local a = summary(r, f[1])
		store = stores[2]
		local b = summary(general(), f[1])
		if a ~= b then
			io.stderr:write("common case and general path differ at step ", steps + 1, ":\n  ",
				line, "\n  common  ", a, "\n  general ", b, "\n")
			os.exit(1)
		end
	end
	-- Expiry runs on the server's clock: a step at the caller's time leaves
	-- the key without one.
	if f[3] ~= "server" and store[f[1]] and store[f[1]].px ~= "" then
		io.stderr:write("a step at the caller's time set an expiry at step ", steps + 1, ":\n  ",
			line, "\n  ", store[f[1]].px, "\n")
		os.exit(1)
	end
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
if general then
	print(string.format("lua differential: %d steps in %d sequences, %d of them decided by the "
		.. "common case, each the same with it off; no difference", steps, n, common))
	if common == 0 then
		io.stderr:write("the common case decided no step\n")
		os.exit(1)
	end
else
	print(string.format("lua differential: %d steps in %d sequences, no difference", steps, n))
end
