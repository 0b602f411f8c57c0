-- SPDX-License-Identifier: MIT
--
-- libtokenbucket-redis as a Redis 7 function library: the script
-- (tokenbucket.lua), unchanged, as the local function script(KEYS, ARGV),
-- and in front of it this file, which decides the calls the client makes
-- most, allow and allow_all on the server's clock asking for integers
-- (ARGV[8] "1", allow_all's last argument "1"), as the script's common
-- cases decide them, and hands every other call to the script.  The
-- build writes the library: a "#!lua name=tokenbucket_<hash>" line, the
-- script wrapped as that function, this file, and the registration of the
-- function of the library's name (tokenbucket-redis(7), THE FUNCTION;
-- docs/redis.md, "The function library").
--
-- What a function has that a script has not is state kept from call to
-- call, in this chunk's locals.  It keeps only what is a pure function of
-- strings it was given, so that every answer is the one the script gives
-- (the lua differential runs both on the same steps):
--   cfgs[tokens][period][burst]  the configuration read and checked,
--                                { p, q, burst, "tokens period burst" }
--                                or false (the script decides the call)
--   nss[n]                       n read and checked, or false
--   secs[s]                      TIME's seconds read (the last one only)
--   msm[ms]                      an expiry in ms as the decimal SET takes
--   mv, m1 .. m5                 the last stored value read or written and
--                                what it says: clock (m1, m2), level, rem,
--                                configuration text
--   av, ah, al, an, at           the same for allow_all's "tbs1" values
--                                (at allow_all's path below)
-- Each table is bounded: past 256 entries it starts again empty.  So the
-- common call checks no pattern and reads no number from a string but
-- TIME's microseconds, and on a hot key does not parse the value it wrote
-- the call before.  The arithmetic is the script's common case's own
-- text: the build puts in place of each line "-- @shared NAME" below the
-- script's lines marked as region NAME (function-library.sh), muldiv for
-- products past 2^53 included, so the names a region uses are this file's
-- too.  A value is written with one format of two integers and one
-- concatenation, a "tbs1" value with one format.  A call handed to the
-- script after TIME and GET has written nothing: the script reads both
-- again and decides it at its own TIME, as if it came a few microseconds
-- later.

local find, match, format, fmod, unpk -- bound at the first call: a library's load sees no "string"
local wide -- %d writes every integer below 2^53 (a C long of 64 bits); set with them
local LIM = 9007199254740992 -- 2^53
local BIL = 1000000000
local cfgs, ncfgs = {}, 0
local nss, nns = {}, 0
local secs = {}
local msm, nms = {}, 0
local mv, m1, m2, m3, m4, m5

-- @shared muldiv

-- The call's configuration as the script's common case checks it (digits,
-- from 1, no leading 0, each below 10^15), memoized.
local function config(a, b, u)
	local cfg = a .. " " .. b .. " " .. u
	local c = false
	if find(cfg, "^[1-9]%d* [1-9]%d* [1-9]%d*$") then
		local p, q, sb = a + 0, b + 0, u + 0
		if p < 1e15 and q < 1e15 and sb < 1e15 then
			c = { p, q, sb, cfg }
		end
	end
	if ncfgs >= 256 then
		cfgs, ncfgs = {}, 0
	end
	local t = cfgs[a]
	if not t then
		t = {}
		cfgs[a] = t
	end
	local t2 = t[b]
	if not t2 then
		t2 = {}
		t[b] = t2
	end
	t2[u] = c
	ncfgs = ncfgs + 1
	return c
end

local function bind()
	find, match, format, fmod, unpk = string.find, string.match, string.format, math.fmod, unpack
	wide = format("%d", 9007199254740991) == "9007199254740991"
end

-- wait, later and clock serve allow_all's refusals and rarer cases; the
-- single allow and allow_all's granted path keep the same lines inline,
-- as each call adds about 8 Lua instructions to the 240 of a hot key's
-- allow (lua5.1's count hook).

-- n: digits, at most 15 of them (the script takes more, with leading
-- zeros, and decides such a call itself).
local function count(s)
	local n = false
	if #s <= 15 and find(s, "^%d+$") then
		n = s + 0
	end
	if nns >= 256 then
		nss, nns = {}, 0
	end
	nss[s] = n
	nns = nns + 1
	return n
end

local function seconds(s)
	local h = s + 0
	secs = { [s] = h }
	return h
end

-- A stored value as the script's common case reads it, kept as the last
-- one; false for one it leaves to the general path.
local function parse(stored)
	local sh, sl, l, r, sc
	-- @shared value
	if not sh or #l > 16 or #r > 15 then
		return false
	end
	-- "-0" + 0 is -0, and -0 + 0 is 0: a level written "-0" reads as 0.
	local h0, l0, lv, rem = sh + 0, sl + 0, l + 0, r + 0
	if h0 < 1 or h0 > 9223372036 or (h0 == 9223372036 and l0 >= 854775807) or lv <= -1e15 then
		return false
	end
	mv, m1, m2, m3, m4, m5 = stored, h0, l0, lv, rem, sc
	return true
end


-- w ns from (th, tl), or -1 if that is at or past INT64_MAX (never).
local function later(w, th, tl)
	-- @shared later
	if h > 9223372036 or (h == 9223372036 and lo >= 854775807) then
		return -1
	end
	return w
end

-- The server's clock as (th, tl): whole seconds from 1 on, and ns, below
-- INT64_MAX, and TIME's reply; nil for any other.
local function clock()
	local tm = redis.call("TIME")
	local th = secs[tm[1]]
	if not th then
		th = seconds(tm[1])
	end
	local tl = tm[2] * 1000
	if th < 1 or tl >= BIL or th > 9223372036 or (th == 9223372036 and tl >= 854775807) then
		return nil
	end
	return th, tl, tm
end

-- The least w with w p >= d q - rem, d > 0: the ns from (th, tl) until d
-- more tokens are there; -1 if that is at or past INT64_MAX (never), false
-- past what doubles hold exactly (2^53 ns or more).  fmod is exact, and so
-- then is the division of what it leaves; past 2^53, d q - rem is
-- (d - 1) q + (q - rem), for muldiv.  From (0, 0) no wait below 2^53 is
-- never: wait(d, p, q, rem, 0, 0) or LIM is the span alone (allow_all's).
local function wait(d, p, q, rem, th, tl)
	local x, w, m = d * q - rem
	if x < LIM then
		m = fmod(x, p)
		w = (x - m) / p
	else
		w, m = muldiv(d - 1, q, q - rem, p)
	end
	if m > 0 then
		w = w + 1
	end
	if w >= LIM then
		return false
	end
	-- @shared later
	if h > 9223372036 or (h == 9223372036 and lo >= 854775807) then
		return -1
	end
	return w
end

local function msstr(ms)
	local s = format("%.0f", ms)
	if nms >= 256 then
		msm, nms = {}, 0
	end
	msm[ms] = s
	nms = nms + 1
	return s
end

-- allow_all's own path: as the script's common case for allow_all, on the
-- server's clock asking for integers (a last argument "1").  Kept from
-- call to call as the single path keeps its value: av the last value
-- read or written ("tbs1 ..."), ah, al its clock, an its number of
-- limits, and at its words as the value's format takes them: the clock's
-- text at[1], then level, rem and configuration text of limit i at
-- at[3i-1 .. 3i+1].  Per call, without allocating: cs[i] the
-- configuration of limit i, and nat, at's twin, the words of the value
-- the call would write (each limit at the call's time, n taken), which
-- becomes at when it is written; a refused call leaves at as it was.
local av, ah, al, an
local at, nat, cs = {}, {}, {}

-- The formats of a value of m limits, "tbs1 %s" then " %d %d %s" (fmtd) or
-- " %.0f %.0f %s" (fmtf) per limit.
local fmtd, fmtf = {}, {}
local function fmts(m)
	fmtd[m] = "tbs1 %s" .. string.rep(" %d %d %s", m)
	fmtf[m] = "tbs1 %s" .. string.rep(" %.0f %.0f %s", m)
	return fmtd[m]
end

-- A "tbs1" value as the script's common case reads it, kept as the last
-- one; false for one it leaves to the general path.
local function parse_all(stored)
	av = nil
	local sh, sl, pos
	-- @shared values
	if not sh then
		return false
	end
	local h0, l0 = sh + 0, sl + 0
	if h0 > 9223372036 or (h0 == 9223372036 and l0 >= 854775807) then
		return false
	end
	local i, len = 1, #stored
	while pos <= len do
		-- @shared values-limit
		if not l or #l > 15 or #r > 15 or i > 48 then
			return false
		end
		at[i + 1], at[i + 2], at[i + 3], i, pos = l + 0, r + 0, c, i + 3, e
	end
	at[1] = sh .. sl
	av, ah, al, an = stored, h0, l0, (i - 1) / 3
	return true
end

local function all(KEYS, ARGV)
	local nargs = #ARGV
	if ARGV[nargs] ~= "1" or ARGV[2] ~= "" or #KEYS ~= 1 or nargs % 3 ~= 1 or nargs < 7
		or nargs > 52 then
		return script(KEYS, ARGV)
	end
	if not find then
		bind()
	end
	local n = nss[ARGV[3]]
	if n == nil then
		n = count(ARGV[3])
	end
	if not n then
		return script(KEYS, ARGV)
	end
	local m = (nargs - 4) / 3
	for i = 1, m do
		local j = 3 * i
		local a, b, u = ARGV[j + 1], ARGV[j + 2], ARGV[j + 3]
		local c = cfgs[a]
		c = c and c[b]
		if c then
			c = c[u]
		end
		if c == nil then
			c = config(a, b, u)
		end
		if not c or n > c[3] then
			return script(KEYS, ARGV)
		end
		cs[i] = c
	end
	local key = KEYS[1]
	local th, tl, tm = clock()
	if not th then
		return script(KEYS, ARGV)
	end
	-- t = max(now, clock), ts the clock's text when t is the clock; dt
	-- the ns from the clock to t, nil for a new key.
	local stored = redis.call("GET", key)
	local ts, dt
	if stored then
		if stored ~= av and not parse_all(stored) then
			return script(KEYS, ARGV)
		end
		if an ~= m then
			return script(KEYS, ARGV)
		end
		if th < ah or (th == ah and tl < al) then
			th, tl, ts = ah, al, at[1]
		end
		local dh = th - ah
		if dh >= 9007198 then
			return script(KEYS, ARGV)
		end
		dt = dh * BIL + (tl - al)
	end
	-- Each limit at t (a new key's full) with n taken, into nat; short
	-- the first limit that holds less than n.  Until one is short: index
	-- and low the limit left with the fewest and what it holds, wf the
	-- latest time until a limit is full, in ns from t.
	local short, index, low, wf = nil, nil, nil, 0
	for i = 1, m do
		local c, k = cs[i], 3 * i
		local p, q, sb = c[1], c[2], c[3]
		local lv, rem = sb, 0
		if dt then
			lv, rem = at[k - 1], at[k]
			if at[k + 1] ~= c[4] or rem >= q or lv > sb then
				return script(KEYS, ARGV)
			end
			-- @shared refill-all
		end
		lv = lv - n
		nat[k - 1], nat[k], nat[k + 1] = lv, rem, c[4]
		if lv < 0 then
			short = short or i
		elseif not short then
			if not low or lv < low then
				index, low = i, lv
			end
			if lv < sb then
				-- the span of wait(sb - lv, p, q, rem, 0, 0), inline below 2^53
				local y = (sb - lv) * q - rem
				local d
				if y < LIM then
					local r = fmod(y, p)
					d = (y - r) / p
					if r > 0 then
						d = d + 1
					end
				else
					d = wait(sb - lv, p, q, rem, 0, 0) or LIM
				end
				if d > wf then
					wf = d
				end
			end
		end
	end
	-- Refused: nothing taken, nothing written; w the latest wait for n, wf
	-- until every limit is full, from the levels before the take.
	if short then
		local w
		w, wf = 0, 0
		for i = 1, m do
			local c, k = cs[i], 3 * i
			local lv, rem, sb = nat[k - 1] + n, nat[k], c[3]
			if lv < n then
				local d = wait(n - lv, c[1], c[2], rem, 0, 0) or LIM
				if d > w then
					w = d
				end
			end
			if lv < sb then
				local d = wait(sb - lv, c[1], c[2], rem, 0, 0) or LIM
				if d > wf then
					wf = d
				end
			end
		end
		-- A span past what doubles hold, or t + wf (the latest time of
		-- all, wf >= w) at or past INT64_MAX: the script says it.  wf is
		-- below 2^53 ns (9007200 s), so only a clock from 9214364836 s on
		-- can reach it.
		if wf >= LIM or (th >= 9214364836 and later(wf, th, tl) < 0) then
			return script(KEYS, ARGV)
		end
		return { 0, short - 1, nat[3 * short - 1] + n, w, wf }
	end
	if wf >= LIM or (th >= 9214364836 and later(wf, th, tl) < 0) then
		return script(KEYS, ARGV)
	end
	at, nat = nat, at
	if not ts then
		-- @shared time-text
	end
	-- The value in one format, from at, which so becomes what parse_all
	-- would read from it (if its clock has 19 digits): %d where a C long
	-- holds every number.
	local small = true
	if not wide then
		for i = 1, m do
			if at[3 * i - 1] >= 2147483648 or at[3 * i] >= 2147483648 then
				small = false
			end
		end
	end
	at[1] = ts
	local value
	if m == 2 then
		-- Two limits, the common set: the numbers by format, the texts
		-- joined (format's %s copies each through sprintf).
		local f = small and " %d %d " or " %.0f %.0f "
		value = "tbs1 " .. ts .. format(f, at[2], at[3]) .. at[4] .. format(f, at[5], at[6]) .. at[7]
	else
		local f = fmtd[m] or fmts(m)
		value = format(small and f or fmtf[m], unpk(at, 1, 3 * m + 1))
	end
	av, ah, al, an = th >= 1000000000 and value or nil, th, tl, m
	-- ns up, to ms, a second more
	local ms
	-- @shared expiry
	redis.call("SET", key, value, "PX", msm[ms] or msstr(ms))
	return { 1, index - 1, low, 0, wf }
end

local function call(KEYS, ARGV)
	if ARGV[8] ~= "1" or ARGV[1] ~= "allow" or ARGV[2] ~= "" or #ARGV ~= 8 or #KEYS ~= 1 then
		if ARGV[1] == "allow_all" then
			return all(KEYS, ARGV)
		end
		return script(KEYS, ARGV)
	end
	if not find then
		bind()
	end
	local a, b, u = ARGV[3], ARGV[4], ARGV[5]
	local c = cfgs[a]
	c = c and c[b]
	if c then
		c = c[u]
	end
	if c == nil then
		c = config(a, b, u)
	end
	if not c then
		return script(KEYS, ARGV)
	end
	local p, q, sb = c[1], c[2], c[3]
	local n = nss[ARGV[6]]
	if n == nil then
		n = count(ARGV[6])
	end
	if not n or n > sb then
		return script(KEYS, ARGV)
	end
	local key = KEYS[1]
	-- now as (th, tl): whole seconds from 1 on, and ns, below INT64_MAX.
	local tm = redis.call("TIME")
	local th = secs[tm[1]]
	if not th then
		th = seconds(tm[1])
	end
	local tl = tm[2] * 1000
	if th < 1 or tl >= BIL or th > 9223372036 or (th == 9223372036 and tl >= 854775807) then
		return script(KEYS, ARGV)
	end
	-- The bucket: clock (h0, l0), level lv (negative in debt), fraction rem/q.
	local h0, l0, lv, rem
	local stored = redis.call("GET", key)
	if stored then
		if stored ~= mv and not parse(stored) then
			return script(KEYS, ARGV)
		end
		if m5 ~= c[4] or m4 >= q or m3 > sb then
			return script(KEYS, ARGV)
		end
		h0, l0, lv, rem = m1, m2, m3, m4
	else
		-- A new bucket is full and sees its first time now.
		h0, l0, lv, rem = th, tl, sb, 0
	end
	-- t = max(now, clock); ts its decimal when it is the clock
	local ts
	if th < h0 or (th == h0 and tl < l0) then
		th, tl, ts = h0, l0, format("%.0f%09.0f", h0, l0)
	end
	local dh = th - h0
	if dh >= 9007198 then
		return script(KEYS, ARGV)
	end
	-- @shared refill
	-- When n tokens are there: w ns from t (-1: never).
	local w = 0
	local d = n - lv
	if d > 0 then
		w = wait(d, p, q, rem, th, tl)
		if not w then
			return script(KEYS, ARGV)
		end
	else
		lv = lv - n
	end
	-- When the bucket is full again: wf ns from t (-1: never); ms: the
	-- key's expiry, a second after that (false: none).
	local wf, ms = 0, 1000
	d = sb - lv
	if d > 0 then
		wf = wait(d, p, q, rem, th, tl)
		if not wf then
			return script(KEYS, ARGV)
		elseif wf < 0 then
			ms = false
		else
			-- ns up, to ms, a second more
			-- @shared expiry
		end
	end
	-- Refused on the server's clock: nothing to write (the script's "Refusals
	-- write nothing").
	if w ~= 0 then
		return { 0, lv, w, wf }
	end
	-- level and rem in one format, %d where a C long of 32 bits holds them
	local tail
	if lv < 2147483648 and lv > -2147483648 and rem < 2147483648 then
		tail = format(" %d %d ", lv, rem)
	else
		tail = format(" %.0f %.0f ", lv, rem)
	end
	if not ts then
		-- @shared time-text
	end
	local value = "tb1 " .. ts .. tail .. c[4]
	-- Kept as parse would read it: a clock of 19 digits.
	if th >= 1000000000 then
		mv, m1, m2, m3, m4, m5 = value, th, tl, lv, rem, c[4]
	end
	if ms then
		redis.call("SET", key, value, "PX", msm[ms] or msstr(ms))
	else
		redis.call("SET", key, value)
	end
	return { 1, lv, 0, wf }
end
