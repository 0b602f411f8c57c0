-- SPDX-License-Identifier: MIT
--
-- usage: lua5.1 driver-set.lua SCRIPT [--function LIBRARY] < steps
--
-- The differential of allow_all (several limits in one key) outside Redis:
-- runs SCRIPT with redis.call reduced to GET, SET and TIME on a table, on
-- the steps "tokenbucket-redis-diffgen set" writes,
--   key now n count tokens period burst ... | allowed index limit remaining retry reset
-- (or "| E2BIG"), the local library's set answer, and checks the reply
-- read as the client reads it (tokenbucket_redis_allow_all_at) against it,
-- exactly.  A step at the caller's time must leave no expiry.  Every step
-- also runs with allow_all's common case turned off, on a store of its
-- own, and must reply and store the same; and asking for integers (a last
-- argument "1"), on a store of its own: the same value, and the same reply
-- or the same in integers.  With --function every step also runs, moved
-- to the server's clock where its time allows (whole microseconds), on the
-- function of LIBRARY and on the script, on stores of their own, and both
-- must reply and store the same.  Exits 1 at the first difference.
local script = assert(loadfile(arg[1]))
-- The same script with allow_all's common case turned off.
local general
do
	local f = assert(io.open(arg[1]))
	local src = f:read("*a")
	f:close()
	local gate = "\nlocal quick = several\n"
	local i, j = string.find(src, gate, 1, true)
	if not i or string.find(src, gate, j, true) then
		io.stderr:write("driver-set.lua: allow_all's common case's gate is not once in ", arg[1], "\n")
		os.exit(1)
	end
	general = assert(loadstring(string.sub(src, 1, i) .. "local quick = false\n"
		.. string.sub(src, j + 1), "=general"))
end
local library, fscript
if arg[2] == "--function" and arg[3] then
	local f = assert(io.open(arg[3]))
	local text = f:read("*a")
	f:close()
	library = assert(loadstring(string.gsub(text, "^#![^\n]*", ""), "=library"))
	local at = string.find(text, "\nlocal function script%(KEYS, ARGV%)\n")
	if not at then
		io.stderr:write("driver-set.lua: no script function in ", arg[3], "\n")
		os.exit(1)
	end
	fscript = select(2, string.gsub(string.sub(text, 1, at), "\n", "")) + 1

elseif arg[2] then
	io.stderr:write("usage: lua5.1 driver-set.lua SCRIPT [--function LIBRARY] < steps\n")
	os.exit(2)
end
local stores, store = { {}, {}, {}, {}, {}, {}, {}, {} }, nil
local compacts = 0
local clock = { "1700000000", "0" }
-- GETs made during a step by the function library's own code and by its
-- script (the function defined at line watch of the library): a step with
-- only the former was decided by the library's path.
local watch, own, others, fast = false, 0, 0, 0
redis = {
	call = function(cmd, k, v, px, ms)
		if cmd == "GET" then
			if watch and debug.getinfo(2, "S").linedefined ~= watch then
				own = own + 1
			elseif watch then
				others = others + 1
			end
			return store[k] and store[k].value or false
		elseif cmd == "SET" then
			store[k] = { value = v, px = px and (px .. " " .. ms) or "" }
			return { ok = "OK" }
		elseif cmd == "TIME" then
			return { clock[1], clock[2] }
		end
		error("unexpected command " .. tostring(cmd))
	end,
	error_reply = function(msg)
		return { err = msg }
	end,
}
-- allow_all's general path reads its numbers with unsigned(), which the
-- common case never calls: a step without its find(s, "%D") was decided
-- by the common case.
local sfind, generals, common = string.find, 0, 0
string.find = function(s, pat, ...)
	if pat == "%D" then
		generals = generals + 1
	end
	return sfind(s, pat, ...)
end
local fcall
if library then
	redis.register_function = function(name, f)
		fcall = f
	end
	library()
	redis.register_function = nil
end

local NEVER = "9223372036854775807"
-- t - now in ns as the client reads it (both decimal int64): 0 if t <= now,
-- NEVER for never and for a span no int64 holds.  Exact: halves of 9 digits.
local function split(s)
	local neg = string.sub(s, 1, 1) == "-"
	local d = neg and string.sub(s, 2) or s
	local h = #d > 9 and tonumber(string.sub(d, 1, -10)) or 0
	local l = tonumber(string.sub(d, -9))
	if neg then
		if l == 0 then
			return -h, 0
		end
		return -h - 1, 1e9 - l
	end
	return h, l
end
local function until_(t, now)
	if t == NEVER then
		return NEVER
	end
	local th, tl = split(t)
	local nh, nl = split(now)
	local h, l = th - nh, tl - nl
	if l < 0 then
		h, l = h - 1, l + 1e9
	end
	if h < 0 or (h == 0 and l == 0) then
		return "0"
	end
	-- INT64_MAX = 9223372036 854775807
	if h > 9223372036 or (h == 9223372036 and l >= 854775807) then
		return NEVER
	end
	if h == 0 then
		return string.format("%d", l)
	end
	return string.format("%d%09d", h, l)
end

-- An integers reply c the same as r, which may be the same or decimal.
local function same_reply(c, r)
	if #c == 5 and #r == 6 then
		return not r.err and c[1] == r[1] and c[2] == r[2] and c[3] == tonumber(r[4])
			and until_(r[5], r[3]) == string.format("%.0f", c[4])
			and until_(r[6], r[3]) == string.format("%.0f", c[5])
	end
	return (c.err or table.concat(c, " ")) == (r.err or table.concat(r, " "))
end

local function summary(r, k)
	local got = r.err and ("error " .. r.err) or table.concat(r, " ")
	local st = store[k]
	return got .. " | " .. (st and (st.value .. " " .. st.px) or "nil")
end

local steps, keys, allowed, refused, fsteps = 0, {}, 0, 0, 0
for line in io.lines() do
	local args, want = string.match(line, "^(.-) | (.*)$")
	local f = {}
	for w in string.gmatch(args, "%S+") do
		f[#f + 1] = w
	end
	local k, now, n, count = f[1], f[2], f[3], tonumber(f[4])
	KEYS = { k }
	ARGV = { "allow_all", now, n }
	for i = 1, 3 * count do
		ARGV[3 + i] = f[4 + i]
	end
	keys[k] = true
	store = stores[1]
	local generals0 = generals
	local r = script()
	steps = steps + 1
	if generals == generals0 then
		common = common + 1
	end
	local a = summary(r, k)
	store = stores[4]
	local b = summary(general(), k)
	if a ~= b then
		io.stderr:write("common case and allow_all differ at step ", steps, ":\n  ", line,
			"\n  common  ", a, "\n  general ", b, "\n")
		os.exit(1)
	end
	-- Asking for integers (a last argument "1"): the same store, and the
	-- same reply or the same in integers.
	store = stores[6]
	ARGV[#ARGV + 1] = "1"
	local c = script()
	ARGV[#ARGV] = nil
	local s1, s6 = stores[1][k], stores[6][k]
	local same = (s1 and s1.value .. " " .. s1.px or "nil") == (s6 and s6.value .. " " .. s6.px or "nil")
	if same and #c == 5 then
		compacts = compacts + 1
	end
	if same then
		same = same_reply(c, r)
	end
	if not same then
		io.stderr:write("integers and decimals differ at step ", steps, ":\n  ", line,
			"\n  decimals ", summary(r, k), "\n  integers ", c.err or table.concat(c, " "),
			" | ", s6 and s6.value or "nil", "\n")
		os.exit(1)
	end
	store = stores[1]
	local got
	if r.err then
		got = "error " .. r.err
	elseif r[1] == 2 then
		got = "E2BIG"
	else
		-- limit: the burst of limit index, as the client takes it from the call
		local burst = f[4 + 3 * r[2] + 3]
		got = table.concat({ r[1], r[2], burst, r[4], r[1] == 1 and "0" or until_(r[5], r[3]),
			until_(r[6], r[3]) }, " ")
		if r[1] == 1 then
			allowed = allowed + 1
		else
			refused = refused + 1
		end
	end
	if got ~= want then
		io.stderr:write("difference at step ", steps, ":\n  ", line, "\n  got  ", got, "\n")
		os.exit(1)
	end
	if store[k] and store[k].px ~= "" then
		io.stderr:write("a step at the caller's time set an expiry at step ", steps, ":\n  ",
			line, "\n")
		os.exit(1)
	end
	if fcall then
		-- On the server's clock where now is whole microseconds from 1 s on.
		local argv = {}
		for i = 1, #ARGV do
			argv[i] = ARGV[i]
		end
		local s, u = string.match(now, "^([1-9]%d*)(%d%d%d%d%d%d)000$")
		if s then
			argv[2], clock = "", { s, tostring(tonumber(u)) }
		end
		ARGV = argv
		store = stores[2]
		local a = summary(script(), k)
		store = stores[3]
		local b = summary(fcall({ k }, argv), k)
		store = stores[5]
		local c = summary(general(), k)
		if a ~= b or a ~= c then
			io.stderr:write("script, function and general path differ at step ", steps, ":\n  ",
				line, "\n  script   ", a, "\n  function ", b, "\n  general  ", c, "\n")
			os.exit(1)
		end
		-- And asking for integers, as the client does, every step on the
		-- server's clock (its time to the microsecond below, where it is
		-- 1 s or more): the library's own path where it can, the script's
		-- store exactly and the script's reply (in integers where it is
		-- in decimals and the library's path decided the step).
		argv[#argv + 1] = "1"
		s, u = string.match(now, "^([1-9]%d*)(%d%d%d%d%d%d)%d%d%d$")
		if s then
			argv[2], clock = "", { s, tostring(tonumber(u)) }
		end
		store = stores[7]
		local sr = script()
		local d = summary(sr, k)
		store = stores[8]
		watch, own, others = fscript, 0, 0
		local fr = fcall({ k }, argv)
		local e = summary(fr, k)
		watch = false
		if own > 0 and others == 0 then
			fast = fast + 1
		end
		-- The same store; the same reply, or in integers where the
		-- library's own path decides what the script's general path did.
		local s7, s8 = stores[7][k], stores[8][k]
		if (s7 and s7.value .. " " .. s7.px or "nil") ~= (s8 and s8.value .. " " .. s8.px or "nil")
			or not same_reply(fr, sr) then
			io.stderr:write("script and function differ in integers at step ", steps, ":\n  ",
				line, "\n  script   ", d, "\n  function ", e, "\n")
			os.exit(1)
		end
		fsteps = fsteps + 1
	end
end
-- A stored fraction that is no multiple of gcd(tokens, period), which no
-- writer makes from a new key but a value may hold, past 2^53 ns·tokens
-- since its clock: the library's own path, the script and its general
-- path, the same.
if fcall then
	local value = "tbs1 1700000000000000000 999999000 1234567 1000000000 3600000000000 1000000000"
		.. " 3 1 10 1000000000 10"
	local argv = { "allow_all", "", "1", "1000000000", "3600000000000", "1000000000", "10",
		"1000000000", "10", "1" }
	clock = { "1700000000", "20000" }
	stores[7].g, stores[8].g = { value = value, px = "" }, { value = value, px = "" }
	store, KEYS, ARGV = stores[7], { "g" }, argv
	local sr = script()
	store = stores[8]
	watch, own, others = fscript, 0, 0
	local fr = fcall({ "g" }, argv)
	watch = false
	stores[9] = { g = { value = value, px = "" } }
	store = stores[9]
	local gr = general()
	if stores[7].g.value .. stores[7].g.px ~= stores[8].g.value .. stores[8].g.px
		or stores[7].g.value .. stores[7].g.px ~= stores[9].g.value .. stores[9].g.px
		or not same_reply(fr, sr) or not same_reply(sr, gr) or own == 0 or others ~= 0 then
		io.stderr:write("script and function differ on a fraction past a gcd:\n  script   ",
			sr.err or table.concat(sr, " "), " | ", stores[7].g.value, "\n  function ",
			fr.err or table.concat(fr, " "), " | ", stores[8].g.value, "\n  general  ",
			gr.err or table.concat(gr, " "), " | ", stores[9].g.value, "\n")
		os.exit(1)
	end
end
local nk = 0
for _ in pairs(keys) do
	nk = nk + 1
end
print(string.format("lua differential of allow_all: %d steps in %d sequences (%d taken, %d "
	.. "refused), no difference; %d decided by the common case, each the same with it off, "
	.. "%d replied in integers; the function library the same on %d, %d of them in integers "
	.. "decided by its own path", steps, nk, allowed, refused, common, compacts, fsteps, fast))
if allowed == 0 or refused == 0 or common == 0 or (fcall and fast == 0) then
	io.stderr:write("no step was taken, none refused, none decided by the common case, or "
		.. "none by the function library's own path\n")
	os.exit(1)
end
