-- SPDX-License-Identifier: MIT
--
-- libtokenbucket-redis as a Redis 7 function library: the script
-- (tokenbucket.lua), unchanged, as the local function script(KEYS, ARGV),
-- and in front of it this file, which decides the call the client makes
-- most, allow on the server's clock asking for integers (ARGV[8] "1"), as
-- the script's common case decides it, and hands every other call to the
-- script.  The build writes the library: a "#!lua name=tokenbucket_<hash>"
-- line, the script wrapped as that function, this file, and the
-- registration of the function of the library's name (tokenbucket-redis(7),
-- THE FUNCTION; docs/redis.md, "The function library").
--
-- What a function has that a script has not is state kept from call to
-- call, in this chunk's locals.  It keeps only what is a pure function of
-- strings it was given, so that every answer is the one the script gives
-- (the lua differential runs both on the same steps):
--   cfgs[tokens][period][burst]  the configuration read and checked,
--                                { p, q, burst, "tokens period burst" } or
--                                false (the script decides the call)
--   nss[n]                       n read and checked, or false
--   secs[s]                      TIME's seconds read (the last one only)
--   msm[ms]                      an expiry in ms as the decimal SET takes
--   mv, m1 .. m5                 the last stored value read or written and
--                                what it says: clock (m1, m2), level, rem,
--                                configuration text
-- Each table is bounded: past 256 entries it starts again empty.  So the
-- common call checks no pattern and reads no number from a string but
-- TIME's microseconds, and on a hot key does not parse the value it wrote
-- the call before.  The arithmetic is the script's common case, line for
-- line; a value is written with one format of two integers and one
-- concatenation.  A call handed to the script after TIME and GET has
-- written nothing: the script reads both again and decides it at its own
-- TIME, as if it came a few microseconds later.

local find, match, format, fmod -- bound at the first call: a library's load sees no "string"
local LIM = 9007199254740992 -- 2^53
local BIL = 1000000000
local cfgs, ncfgs = {}, 0
local nss, nns = {}, 0
local secs = {}
local msm, nms = {}, 0
local mv, m1, m2, m3, m4, m5

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
	local sh, sl, l, r, sc = match(stored,
		"^tb1 ([1-9]%d%d%d%d%d%d%d%d%d)(%d%d%d%d%d%d%d%d%d) (%-?%d+) (%d+) (.*)$")
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

-- The least w with w p >= d q - rem, d > 0: the ns from (th, tl) until d
-- more tokens are there; -1 if that is at or past INT64_MAX (never), false
-- past what doubles hold exactly.  fmod is exact, and so then is the
-- division of what it leaves.
local function wait(d, p, q, rem, th, tl)
	local x = d * q - rem
	if x >= LIM then
		return false
	end
	local m = fmod(x, p)
	local w = (x - m) / p
	if m > 0 then
		w = w + 1
	end
	local wr = fmod(w, BIL)
	local h, lo = th + (w - wr) / BIL, tl + wr
	if lo >= BIL then
		h, lo = h + 1, lo - BIL
	end
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

local function call(KEYS, ARGV)
	if ARGV[8] ~= "1" or ARGV[1] ~= "allow" or ARGV[2] ~= "" or #ARGV ~= 8 or #KEYS ~= 1 then
		return script(KEYS, ARGV)
	end
	if not find then
		find, match, format, fmod = string.find, string.match, string.format, math.fmod
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
	local x = (dh * BIL + (tl - l0)) * p + rem
	if x >= LIM then
		return script(KEYS, ARGV)
	end
	rem = fmod(x, q)
	if lv < sb then
		lv = lv + (x - rem) / q
		if lv > sb then
			lv = sb
		end
	end
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
			ms = (wf + 999999) / 1000000
			ms = ms - ms % 1 + 1000
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
	local value
	if ts then
		value = "tb1 " .. ts .. tail .. c[4]
	else
		-- TIME's microseconds, without leading zeros, to 9 digits.
		local us = tm[2]
		local k = #us
		value = "tb1 " .. tm[1] .. (k == 6 and "" or k == 5 and "0" or k == 4 and "00" or k == 3 and "000"
			or k == 2 and "0000" or "00000") .. us .. "000" .. tail .. c[4]
	end
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
