-- SPDX-License-Identifier: MIT
--
-- usage: lua5.1 driver.lua SCRIPT [--general] [--function LIBRARY] < steps
--
-- Runs the bucket script outside Redis, with redis.call reduced to GET, SET
-- and TIME on a table, and checks each step against what the local library
-- answered (tokenbucket-redis-diffgen writes the steps).  A line is
--   key op now tokens period burst n arg | code act tokens
-- (now "server" asks for the server's clock, which reads 1700000000 s;
-- "server@S.U" for one that reads S s and U us, as TIME replies)
-- code is the reply's code (E: an error reply), act the reservation's
-- time_to_act, both exact; tokens is tokens_at's value, checked to 1e-9
-- relative ("-": not checked).  With --general every step also runs on the
-- script with its common case turned off, on a store of its own, and must
-- give the same reply, the same stored value and the same expiry, and
-- every allow also runs asking for the compact reply (ARGV[8] "1"), on a
-- store of its own, and must leave the same value and expiry and reply
-- either the same or the same in integers.  A step
-- at the caller's time must leave the key without an expiry.  With
-- --function every step also runs asking for the compact reply on the
-- function of LIBRARY (the Redis 7 function library the build writes, its
-- state kept from step to step as a server keeps it), on a store of its
-- own, and must reply and store what the script does.  Exits 1 at the
-- first difference.
local script = assert(loadfile(arg[1]))
local general, library
local opt = 2
if arg[opt] == "--general" then
	local f = assert(io.open(arg[1]))
	local src = f:read("*a")
	f:close()
	local gate = '\nlocal common = op ~= "reset" and not several\n'
	local i, j = string.find(src, gate, 1, true)
	if not i or string.find(src, gate, j, true) then
		io.stderr:write("driver.lua: the common case's gate is not once in ", arg[1], "\n")
		os.exit(1)
	end
	general = assert(loadstring(string.sub(src, 1, i) .. "local common = false\n"
		.. string.sub(src, j + 1), "=general"))
	opt = opt + 1
end
if arg[opt] == "--function" and arg[opt + 1] then
	local f = assert(io.open(arg[opt + 1]))
	-- The "#!lua name=" line is Redis's, not Lua's.
	library = assert(loadstring(string.gsub(f:read("*a"), "^#![^\n]*", ""), "=library"))
	f:close()
	opt = opt + 2
end
if arg[opt] then
	io.stderr:write("usage: lua5.1 driver.lua SCRIPT [--general] [--function LIBRARY] < steps\n")
	os.exit(2)
end
local stores, store = { {}, {}, {}, {}, {} }, nil
local clock = { "1700000000", "0" }
local sets, concats, concat = 0, 0, table.concat
table.concat = function(...)
	concats = concats + 1
	return concat(...)
end

local function reply_error(msg)
	return { err = msg }
end
-- GETs made during a step by the function library's own code and by its
-- script: a step with only the former was decided by the library's path.
local watch, own, others, fast = false, 0, 0, 0
redis = {
	call = function(cmd, k, v, px, ms)
		if cmd == "GET" then
			if watch and debug.getinfo(2, "f").func == watch then
				own = own + 1
			elseif watch then
				others = others + 1
			end
			return store[k] and store[k].value or false
		elseif cmd == "SET" then
			sets = sets + 1
			store[k] = { value = v, px = px and (px .. " " .. ms) or "" }
			return { ok = "OK" }
		elseif cmd == "TIME" then
			return { clock[1], clock[2] }
		end
		error("unexpected command " .. tostring(cmd))
	end,
	error_reply = reply_error,
}
-- The library registers one function, called with KEYS and ARGV.
local fcall, fcalls
if library then
	redis.register_function = function(name, f)
		fcall = f
	end
	library()
	redis.register_function = nil
	fcalls = 0
end

-- A reply and the key's stored value and expiry, as one line.
local function summary(r, k)
	local got = r.err and ("error " .. r.err) or concat(r, " ", 1, 7)
	local st = store[k]
	return got .. " | " .. (st and (st.value .. " " .. st.px) or "nil")
end

local NEVER = "9223372036854775807"
-- a - b in ns for two decimal times from 10^9 on, a >= b (below 2^53 apart).
local function span(a, b)
	local function split(s)
		return tonumber(string.sub(s, 1, -10)), tonumber(string.sub(s, -9))
	end
	local ah, al = split(a)
	local bh, bl = split(b)
	return (ah - bh) * 1e9 + (al - bl)
end

-- Whether a compact reply c says what the full reply f says.
local function same_compact(c, f)
	if c.err or f.err or #c ~= 4 then
		return c.err == f.err and concat(c, " ", 1, #c) == concat(f, " ", 1, #f)
	end
	local function wait(t)
		return t == NEVER and -1 or span(t, f[2])
	end
	return c[1] == f[1] and c[2] == tonumber(f[3]) and c[3] == wait(f[6]) and c[4] == wait(f[7])
end

local steps, keys, common, compacts = 0, {}, 0, 0
for line in io.lines() do
	local args, want = string.match(line, "^(.-) | (.*)$")
	local f = {}
	for w in string.gmatch(args, "%S+") do
		f[#f + 1] = w
	end
	KEYS = { f[1] }
	-- now "server": the server's clock, which the stub's TIME keeps at 1.7e18 ns
	-- unless the step names it.
	local server = string.sub(f[3], 1, 6) == "server"
	ARGV = { f[2], server and "" or f[3], f[4], f[5], f[6], f[7], f[8] }
	clock = { "1700000000", "0" }
	if f[3] ~= "server" and server then
		clock = { string.match(f[3], "^server@(%d+)%.(%d+)$") }
	end
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
	-- Every step also runs asking for the compact reply, which only an
	-- allow may take.
	store = stores[3]
	ARGV[8] = "1"
	local c = script()
	local s1, s3 = stores[1][f[1]], store[f[1]]
	if (s1 and s1.value .. " " .. s1.px or "nil") ~= (s3 and s3.value .. " " .. s3.px or "nil")
		or not same_compact(c, r) or (#c == 4 and f[2] ~= "allow") then
		io.stderr:write("compact and full replies differ at step ", steps + 1, ":\n  ", line,
			"\n  full    ", summary(r, f[1]), "\n  compact ",
			c.err and c.err or concat(c, " ", 1, #c), " | ", s3 and s3.value or "nil", "\n")
		os.exit(1)
	end
	if #c == 4 then
		compacts = compacts + 1
	end
	-- The function: the same reply and the same store as the script's, on
	-- stores of their own, with the step moved to the server's clock (whose
	-- TIME reads its time to the microsecond) where its time allows: the
	-- function's own path decides only allows on the server's clock.
	if fcall then
		local fargs = { ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], "1" }
		local s, u = string.match(ARGV[2], "^([1-9]%d*)(%d%d%d%d%d%d)%d%d%d$")
		if s then
			fargs[2], clock = "", { s, tostring(tonumber(u)) }
		end
		local argv = ARGV
		ARGV = fargs
		store = stores[4]
		local sr = script()
		ARGV = argv
		local s4 = store[f[1]]
		store = stores[5]
		watch, own, others = fcall, 0, 0
		local fr = fcall({ f[1] }, fargs)
		watch = false
		if own > 0 and others == 0 then
			fast = fast + 1
		end
		local s5 = store[f[1]]
		local a = sr.err and sr.err or concat(sr, " ", 1, #sr)
		local b = fr.err and fr.err or concat(fr, " ", 1, #fr)
		if (s4 and s4.value .. " " .. s4.px or "nil") ~= (s5 and s5.value .. " " .. s5.px or "nil")
			or a ~= b then
			io.stderr:write("script and function differ at step ", steps + 1, ":\n  ", line,
				"\n  script   ", a, " | ", s4 and s4.value .. " " .. s4.px or "nil",
				"\n  function ", b, " | ", s5 and s5.value .. " " .. s5.px or "nil", "\n")
			os.exit(1)
		end
		fcalls = fcalls + 1
	end
	store = stores[1]
	-- Expiry runs on the server's clock: a step at the caller's time leaves
	-- the key without one.
	if not server and store[f[1]] and store[f[1]].px ~= "" then
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
		.. "common case, each the same with it off, %d allows replied in integers; no difference",
		steps, n, common, compacts))
	if fcalls then
		print(string.format("lua differential: the function library the same on all %d steps, "
			.. "%d of them decided by its own path", fcalls, fast))
		if fast == 0 then
			io.stderr:write("the function library's own path decided no step\n")
			os.exit(1)
		end
	end
	if common == 0 or compacts == 0 then
		io.stderr:write("the common case decided no step, or replied in integers to none\n")
		os.exit(1)
	end
else
	print(string.format("lua differential: %d steps in %d sequences, no difference", steps, n))
end
