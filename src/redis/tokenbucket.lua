-- SPDX-License-Identifier: MIT
--
-- libtokenbucket-redis: one exact token bucket per key, decided inside Redis.
-- The arguments, the reply and the stored value are documented in
-- tokenbucket-redis(7); docs/redis.md explains the arithmetic.
--
-- KEYS[1]  the bucket's key
-- ARGV[1]  op: "allow", "reserve", "cancel", "refund", "tokens" or "reset"
-- ARGV[2]  now: int64 ns, or "" for the server's clock (TIME)
-- ARGV[3]  tokens  } the rate: tokens per period ns (tokens 0: rate 0)
-- ARGV[4]  period  }
-- ARGV[5]  burst
-- ARGV[6]  n: tokens to allow, reserve or give back; for reset, the level
-- ARGV[7]  allow, refund, tokens, reset: ignored; reserve: max_wait ns (int64,
--          9223372036854775807 = no limit); cancel: the reservation's
--          time_to_act
-- ARGV[8]  optional (1.2): "1" lets an allow reply compactly (below), "0"
--          or no ARGV[8] asks for the reply below
--
-- Several limits in one key (1.2), all or nothing: ARGV[1] "allow_all",
-- ARGV[2] now as above, ARGV[3] n, then tokens, period and burst of each
-- limit, 1 to 16 of them, and optionally a last "1" (or "0") as ARGV[8]
-- for allow; the reply and the stored value ("tbs1 ...") are described at
-- allow_all below.
--
-- Reply: { code, now, level, rem, q, act, full } with code an integer
-- (1 granted or given back, 0 refused, 2 n > burst, 3 debt too large) and the rest decimal
-- strings: the time the bucket has seen, its whole tokens (negative in debt),
-- the fraction of the next token rem/q, the time n tokens are (or were)
-- there, and the time it is full again (9223372036854775807: never).
-- With ARGV[8] "1", an allow the common case decides replies instead
-- { code, level, wait, full } in integers: wait and full in ns from now
-- (-1: never); any other call replies as above, told apart by length.
--
-- Lua numbers are doubles, exact to 2^53 only, so every integer that can be
-- larger lives in an array of base-2^24 limbs, least significant first, with
-- no leading zero limb (zero is {}).  A product of two limbs plus a carry
-- stays below 2^53, so each limb step is exact.  The common case never
-- needs them: it runs first, in doubles, and hands anything larger to the
-- general path.
--
-- The lines between "-- @shared begin NAME" and "-- @shared end" are also
-- the Redis 7 function library's, which the build takes from here
-- (function-library.sh): the names they use are its names too.

local floor, fmod, format, tonumber = math.floor, math.fmod, string.format, tonumber
local find, match = string.find, string.match
local LIM = 9007199254740992 -- 2^53
local NEVER = "9223372036854775807"
local BIL = 1000000000

-- muldiv(A, M, c, D): for x = A M + c with 0 <= A < 2^53 and M, c, D below
-- 2^50 (D >= 1), floor(x / D) and x mod D, exact; the quotient is 2^53
-- when it is 2^53 or more.  The common cases' products past 2^53, in
-- doubles: x as three base-2^26 digits from 26-bit halves of A and M,
-- then long division by D a digit at a time, each digit's quotient from
-- the doubles' ratio (within one of the truth) and its remainder from D's
-- halves.  Every step's bound is in docs/redis.md, "Past 2^53 in
-- doubles".  It uses no upvalue, so that making it costs a call no more
-- than a table; the function library takes this text as it is.
-- @shared begin muldiv
local function muldiv(A, M, c, D)
	local T, fmod = 67108864, math.fmod -- 2^26
	local a0, m0, D0 = A % T, M % T, D % T
	local a1, m1, D1 = (A - a0) / T, (M - m0) / T, (D - D0) / T
	local z = a0 * m0 + c
	local d0 = z % T
	z = a1 * m0 + (z - d0) / T
	local e = z % T
	local h = a1 * m1 + (z - e) / T
	z = a0 * m1 + e
	local d1 = z % T
	h = h + (z - d1) / T
	-- x = (h T + d1) T + d0, h below 2^52
	local r = fmod(h, D)
	local g = (h - r) / D
	local y = (r * T + d1) / D
	local k1 = y - y % 1
	local s = (r - k1 * D1) * T + (d1 - k1 * D0)
	if s < 0 then
		s, k1 = s + D, k1 - 1
	elseif s >= D then
		s, k1 = s - D, k1 + 1
	end
	y = (s * T + d0) / D
	local k0 = y - y % 1
	r = (s - k0 * D1) * T + (d0 - k0 * D0)
	if r < 0 then
		r, k0 = r + D, k0 - 1
	elseif r >= D then
		r, k0 = r - D, k0 + 1
	end
	if g >= 2 then
		return 9007199254740992, r
	end
	g = (g * T + k1) * T + k0
	if g >= 9007199254740992 then
		g = 9007199254740992
	end
	return g, r
end
-- @shared end

-- ---- The call -------------------------------------------------------------------

local key, op, nargs = KEYS[1], ARGV[1], #ARGV
local several = op == "allow_all"
if #KEYS ~= 1 or (not several and nargs ~= 7 and nargs ~= 8)
	or (several and (nargs < 6 or nargs > 52 or nargs % 3 == 2)) then
	return redis.error_reply("ERR tokenbucket: bad argument count")
end
local compact = false
if several and nargs % 3 == 1 then
	-- allow_all's last argument is then its reply form, as ARGV[8] is below.
	compact = ARGV[nargs]
	if compact ~= "1" and compact ~= "0" then
		return redis.error_reply("ERR tokenbucket: bad reply form")
	end
	compact, nargs = compact == "1", nargs - 1
elseif nargs == 8 then
	compact = ARGV[8]
	if compact ~= "1" and compact ~= "0" then
		return redis.error_reply("ERR tokenbucket: bad reply form")
	end
	compact = compact == "1" and op == "allow"
end
if op ~= "allow" and op ~= "reserve" and op ~= "cancel" and op ~= "refund" and op ~= "tokens"
	and op ~= "reset" and op ~= "lease" and op ~= "giveback" and not several then
	return redis.error_reply("ERR tokenbucket: bad op")
end
-- The server's clock is read once, whichever path decides.
local tm = ARGV[2] == "" and redis.call("TIME") or nil
local stored = redis.call("GET", key)

-- ---- The common case, in doubles ------------------------------------------------
-- allow or reserve on a new bucket, or on a stored one whose configuration
-- is the call's, every number below 10^15 (the burst, the rate's two
-- numbers, the level and debt), so that every product of them that
-- passes 2^53 is taken by muldiv, exactly, and only a wait of 2^53 ns or
-- more (104 days) or a span of as many since the clock is left over.  A
-- break hands the call, untouched, to the general path, which decides it
-- alike.  It comes first and is written inline, and it counts
-- the C functions it calls, each of which costs Redis's CPU far more than
-- a line of arithmetic: the arguments and the stored value are checked by
-- one pattern each and read by coercion (a string of digits in arithmetic
-- is its number), lengths bound what a pattern cannot, and numbers below
-- 10^14 become strings by concatenation, which is exact there.  The two
-- waits are written out rather than made a function: a closure allocates
-- its upvalues on every call.  No time is formatted: the bucket's time is
-- the text it came as (the stored clock, the caller's now, or TIME's two
-- halves with the microseconds padded), and a reply's other times only
-- when the caller asked for decimal times.  Nothing is made into a string
-- that is neither written nor replied.

-- The common cases' now as (th, tl): whole seconds from 1 on, and ns,
-- below INT64_MAX; nil for any other (the general paths read it).
local th, tl
if tm then
	th, tl = tm[1] + 0, tm[2] * 1000
elseif op == "allow" or op == "reserve" or several then
	-- 19 digits, the first not 0 (from 2001 on), so that the pattern
	-- never backtracks and the text is the time's decimal.
	local h, l = match(ARGV[2], "^([1-9]%d%d%d%d%d%d%d%d%d)(%d%d%d%d%d%d%d%d%d)$")
	if h then
		th, tl = h + 0, l + 0
	end
end
if th and (th < 1 or tl >= BIL or th > 9223372036 or (th == 9223372036 and tl >= 854775807)) then
	th = nil
end
local common = op == "allow" or op == "reserve"
if common then
	repeat
		local a, b, u, ns = ARGV[3], ARGV[4], ARGV[5], ARGV[6]
		-- Digits only, and tokens, period and burst from 1 on with no
		-- leading zero, as the value is written with them as sent (a rate
		-- or a burst of 0 goes on).
		local cfg = a .. " " .. b .. " " .. u
		if not find(cfg .. " " .. ns, "^[1-9]%d* [1-9]%d* [1-9]%d* %d+$") then
			break
		end
		local p, q, sb, n = a + 0, b + 0, u + 0, ns + 0
		if p >= 1e15 or q >= 1e15 or sb >= 1e15 or n > sb then
			break
		end
		if not th then
			break
		end
		-- The bucket: clock (h0, l0), in decimal sh .. sl, level lv (negative
		-- in debt), fraction rem/q.
		local h0, l0, lv, rem, sh, sl
		if stored then
			-- A clock of 19 digits, again so that the pattern never backtracks
			-- (a variable-length head costs more than the rest of the match),
			-- and with no leading 0, so that sh .. sl is its decimal.
			local l, r, sc
			-- @shared begin value
			sh, sl, l, r, sc = match(stored,
				"^tb1 ([1-9]%d%d%d%d%d%d%d%d%d)(%d%d%d%d%d%d%d%d%d) (%-?%d+) (%d+) (.*)$")
			-- @shared end
			if not sh or sc ~= cfg or #l > 16 or #r > 15 then
				break
			end
			-- "-0" + 0 is -0, and -0 + 0 is 0: a level written "-0" reads as 0.
			h0, l0, lv, rem = sh + 0, sl + 0, l + 0, r + 0
			-- A clock before 1 s or at INT64_MAX, a fraction of a token or
			-- more, more than burst, debt beyond 10^15: not a bucket this
			-- path may write over.
			if h0 < 1 or h0 > 9223372036 or (h0 == 9223372036 and l0 >= 854775807) or rem >= q
				or lv > sb or lv <= -1e15 then
				break
			end
		else
			-- A new bucket is full and sees its first time now.
			h0, l0, lv, rem = th, tl, sb, 0
		end
		-- t = max(now, clock), as (th, tl), and ts its decimal when it is the clock
		local ts
		if th < h0 or (th == h0 and tl < l0) then
			th, tl, ts = h0, l0, sh .. sl
		end
		local dh = th - h0
		if dh >= 9007198 then
			break
		end
		-- got: the tokens made since the clock, 2^53 for as many or more
		-- (more than a burst, then).
		-- @shared begin refill
		local dt = dh * BIL + (tl - l0)
		local x, got = dt * p + rem, nil
		if x < LIM then
			rem = fmod(x, q)
			got = (x - rem) / q
		else
			got, rem = muldiv(dt, p, rem, q)
		end
		if lv < sb then
			lv = lv + got
			if lv > sb then
				lv = sb
			end
		end
		-- @shared end
		-- When n tokens are there: w ns from t (false: never), h, lo as a time.
		-- The least w with w p >= d q - rem; fmod is exact, and so then is
		-- the division of what it leaves.  Past 2^53, d q - rem is
		-- (d - 1) q + (q - rem), for muldiv.
		local w, ah, al = 0, th, tl
		local d = n - lv
		if d > 0 then
			local x = d * q - rem
			local m
			if x < LIM then
				m = fmod(x, p)
				w = (x - m) / p
			else
				w, m = muldiv(d - 1, q, q - rem, p)
				if w >= LIM - 1 then
					break
				end
			end
			if m > 0 then
				w = w + 1
			end
			-- @shared begin later
			local wr = fmod(w, BIL)
			local h, lo = th + (w - wr) / BIL, tl + wr
			if lo >= BIL then
				h, lo = h + 1, lo - BIL
			end
			-- @shared end
			if h > 9223372036 or (h == 9223372036 and lo >= 854775807) then
				w = false
			end
			ah, al = h, lo
		end
		local code = 1
		if op == "allow" then
			if d > 0 then
				code = 0
			end
		else
			-- max_wait: INT64_MAX is no limit; otherwise digits below 10^15
			-- here (a negative one, which no wait is short enough for, goes on).
			local mw = ARGV[7]
			if mw ~= NEVER then
				if #mw > 15 or not find(mw, "^%d+$") then
					break
				end
				if not w or w > mw + 0 then
					code = 0
				end
			end
		end
		if code == 1 then
			lv = lv - n
		end
		-- When the bucket is full again: wf ns from t (false: never), fh, fl
		-- as a time; ms: the key's expiry, a second after that.
		local wf, fh, fl, ms = 0, th, tl, 1000
		d = sb - lv
		if d > 0 then
			local x = d * q - rem
			local m
			if x < LIM then
				m = fmod(x, p)
				wf = (x - m) / p
			else
				wf, m = muldiv(d - 1, q, q - rem, p)
				if wf >= LIM - 1 then
					break
				end
			end
			if m > 0 then
				wf = wf + 1
			end
			local wr = fmod(wf, BIL)
			fh, fl = th + (wf - wr) / BIL, tl + wr
			if fl >= BIL then
				fh, fl = fh + 1, fl - BIL
			end
			if fh > 9223372036 or (fh == 9223372036 and fl >= 854775807) then
				wf, ms = false, false
			else
				-- ns up, to ms, a second more (below 2^53 / 10^6: %.14g is exact)
				-- @shared begin expiry
				ms = (wf + 999999) / 1000000
				ms = ms - ms % 1 + 1000
				-- @shared end
			end
		end
		-- Refused for want of tokens on the server's clock: nothing to write
		-- (see the general path's end), and in integers nothing to format.
		local write = code == 1 or not tm
		if compact and not write then
			return { code, lv, w or -1, wf or -1 }
		end
		if not ts then
			if tm then
				-- @shared begin time-text
				-- TIME's microseconds, without leading zeros, to 9 digits.
				local us = tm[2]
				local k = #us
				ts = tm[1] .. (k == 6 and "" or k == 5 and "0" or k == 4 and "00" or k == 3 and "000"
					or k == 2 and "0000" or "00000") .. us .. "000"
				-- @shared end
			else
				ts = ARGV[2]
			end
		end
		local ls = lv == 0 and "0" or (lv < 1e14 and lv > -1e14) and lv .. "" or format("%.0f", lv)
		local rs = rem == 0 and "0" or rem < 1e14 and rem .. "" or format("%.0f", rem)
		if write then
			local value = "tb1 " .. ts .. " " .. ls .. " " .. rs .. " " .. cfg
			-- Expiry measures the server's clock: a call at the caller's
			-- time writes a key that stays (tokenbucket-redis(7), "Memory").
			if ms and tm then
				redis.call("SET", key, value, "PX", ms)
			else
				redis.call("SET", key, value)
			end
		end
		if compact then
			return { code, lv, w or -1, wf or -1 }
		end
		-- Times as they are written (%d while a C long holds them), the
		-- bucket's own from its text.
		local acts, fulls = NEVER, NEVER
		if w then
			acts = w == 0 and ts or ah < 2147483648 and format("%d%09d", ah, al)
				or format("%.0f%09.0f", ah, al)
		end
		if wf then
			fulls = wf == 0 and ts or fh < 2147483648 and format("%d%09d", fh, fl)
				or format("%.0f%09.0f", fh, fl)
		end
		return { code, ts, ls, rs, b, acts, fulls }
	until true
end

-- ---- allow_all's common case, in doubles --------------------------------------
-- As the single common case: a stored key holding as many limits as the
-- call names, each with the call's configuration, or a new key; every
-- number below 10^15, every product past 2^53 taken by muldiv (a rate per
-- hour passes 2^53 ns·tokens within milliseconds).  A break hands the call,
-- untouched, to allow_all below, which decides it alike.  One table holds
-- what each limit computes.

local quick = several
if quick then
	repeat
		local ns = ARGV[3]
		if #ns > 15 or not find(ns, "^%d+$") then
			break
		end
		local n, count = ns + 0, (nargs - 3) / 3
		if not th then
			break
		end
		-- The stored clock (h0, l0), in decimal sh .. sl, and where its limits start.
		local h0, l0, sh, sl, pos = th, tl
		if stored then
			-- @shared begin values
			sh, sl, pos = match(stored, "^tbs1 ([1-9]%d%d%d%d%d%d%d%d%d)(%d%d%d%d%d%d%d%d%d)()")
			-- @shared end
			if not sh then
				break
			end
			h0, l0 = sh + 0, sl + 0
			if h0 > 9223372036 or (h0 == 9223372036 and l0 >= 854775807) then
				break
			end
		end
		local ts
		if th < h0 or (th == h0 and tl < l0) then
			th, tl, ts = h0, l0, sh .. sl
		end
		local dh = th - h0
		if dh >= 9007198 then
			break
		end
		local dt = dh * BIL + (tl - l0)
		-- v[5i-4 .. 5i]: level, fraction, p, q, burst of limit i; then its
		-- configuration's text at v[5 * count + i].
		-- (Made with room for two limits: a table that grows reallocates.)
		local v, short, fail = { 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0 }, false, false
		for i = 1, count do
			local j = 3 * i
			local cfg = ARGV[j + 1] .. " " .. ARGV[j + 2] .. " " .. ARGV[j + 3]
			local lv, rem, p, q, sb
			if stored then
				-- A configuration of digits with no leading zero equal to the
				-- call's: so the call's is that too.
				-- @shared begin values-limit
				local l, r, c, e = match(stored, "^ (%d+) (%d+) ([1-9]%d* [1-9]%d* [1-9]%d*)()", pos)
				-- @shared end
				if not l or c ~= cfg or #l > 15 or #r > 15 then
					fail = true
					break
				end
				pos, lv, rem = e, l + 0, r + 0
			elseif not find(cfg, "^[1-9]%d* [1-9]%d* [1-9]%d*$") then
				fail = true
				break
			end
			p, q, sb = ARGV[j + 1] + 0, ARGV[j + 2] + 0, ARGV[j + 3] + 0
			if not stored then
				lv, rem = sb, 0
			end
			if p >= 1e15 or q >= 1e15 or sb >= 1e15 or n > sb or rem >= q or lv > sb then
				fail = true
				break
			end
			-- @shared begin refill-all
			local x = dt * p + rem
			local got
			if x < LIM then
				rem = fmod(x, q)
				got = (x - rem) / q
			else
				-- Past 2^53 (10^9 an hour does it in 9 ms).
				got, rem = muldiv(dt, p, rem, q)
			end
			if lv < sb then
				lv = lv + got
				if lv > sb then
					lv = sb
				end
			end
			-- @shared end
			if not short and lv < n then
				short = i
			end
			local k = 5 * i
			v[k - 4], v[k - 3], v[k - 2], v[k - 1], v[k], v[5 * count + i] = lv, rem, p, q, sb, cfg
		end
		if fail or (stored and pos ~= #stored + 1) then
			break
		end
		-- Taken from all or from none; w: the latest wait for n, wf until
		-- full (false: never, or no time a double holds exactly).
		local index, w, wf = short, 0, 0
		for i = 1, count do
			local k = 5 * i
			local lv, rem, p, q, sb = v[k - 4], v[k - 3], v[k - 2], v[k - 1], v[k]
			if not short then
				lv = lv - n
				v[k - 4] = lv
				if not index or lv < v[5 * index - 4] then
					index = i
				end
			elseif w and lv < n then
				local x, d, m = (n - lv) * q - rem
				if x < LIM then
					m = fmod(x, p)
					d = (x - m) / p
				else
					d, m = muldiv(n - lv - 1, q, q - rem, p)
				end
				d = d + (m > 0 and 1 or 0)
				if d >= LIM then
					w = false
				elseif d > w then
					w = d
				end
			end
			if wf and lv < sb then
				local x, d, m = (sb - lv) * q - rem
				if x < LIM then
					m = fmod(x, p)
					d = (x - m) / p
				else
					d, m = muldiv(sb - lv - 1, q, q - rem, p)
				end
				d = d + (m > 0 and 1 or 0)
				if d >= LIM then
					wf = false
				elseif d > wf then
					wf = d
				end
			end
		end
		-- A wait beyond 2^53 ns, or one past INT64_MAX: allow_all says it.
		if not w or not wf then
			break
		end
		-- The times t + w and t + wf, as (h, lo), false past INT64_MAX.
		local wr = fmod(w, BIL)
		local ah, al = th + (w - wr) / BIL, tl + wr
		if al >= BIL then
			ah, al = ah + 1, al - BIL
		end
		local fr = fmod(wf, BIL)
		local fh, fl = th + (wf - fr) / BIL, tl + fr
		if fl >= BIL then
			fh, fl = fh + 1, fl - BIL
		end
		if ah > 9223372036 or (ah == 9223372036 and al >= 854775807) or fh > 9223372036
			or (fh == 9223372036 and fl >= 854775807) then
			break
		end
		local lv = v[5 * index - 4]
		local write = not short or not tm or not stored
		if compact and not write then
			return { short and 0 or 1, index - 1, lv, w, wf }
		end
		if not ts then
			if tm then
				local us = tm[2]
				local k = #us
				ts = tm[1] .. (k == 6 and "" or k == 5 and "0" or k == 4 and "00" or k == 3 and "000"
					or k == 2 and "0000" or "00000") .. us .. "000"
			else
				ts = ARGV[2]
			end
		end
		-- Refused on the server's clock with the stored configuration: nothing to write.
		if write then
			-- v becomes the value's words in place: "tbs1", the clock, then
			-- level, fraction and configuration of each limit in one format
			-- each, %d where a C long holds them (always below 2^31; below
			-- 2^53 if it has 64 bits), which costs less than a double's %.14g.
			local wide
			for i = 1, count do
				local k = 5 * i
				local l, r = v[k - 4], v[k - 3]
				if (l >= 2147483648 or r >= 2147483648) and wide == nil then
					wide = format("%d", 9007199254740991) == "9007199254740991"
				end
				v[i + 2] = format((wide == false and (l >= 2147483648 or r >= 2147483648)) and "%.0f %.0f %s"
					or "%d %d %s", l, r, v[5 * count + i])
			end
			v[1], v[2] = "tbs1", ts
			local value = table.concat(v, " ", 1, count + 2)
			if tm then
				local ms = (wf + 999999) / 1000000
				redis.call("SET", key, value, "PX", ms - ms % 1 + 1000)
			else
				redis.call("SET", key, value)
			end
		end
		if compact then
			return { short and 0 or 1, index - 1, lv, w, wf }
		end
		local level = lv == 0 and "0" or lv < 1e14 and lv .. "" or format("%.0f", lv)
		local acts = w == 0 and ts or ah < 2147483648 and format("%d%09d", ah, al)
			or format("%.0f%09.0f", ah, al)
		local fulls = wf == 0 and ts or fh < 2147483648 and format("%d%09d", fh, fl)
			or format("%.0f%09.0f", fh, fl)
		return { short and 0 or 1, index - 1, ts, level, acts, fulls }
	until true
end

-- Defined here, past the common case, which so makes no closure.
local function bad(what)
	return redis.error_reply("ERR tokenbucket: bad " .. what)
end

-- ---- The general path: times {hi, lo} = hi * 10^9 + lo, 0 <= lo < 10^9 -----
-- Both halves are small doubles, so comparing and subtracting nearby times
-- costs no limbs.

local TMAX = { 9223372036, 854775807 }  -- INT64_MAX: never
local TMIN = { -9223372037, 145224192 } -- INT64_MIN
local TMIN1 = { -9223372037, 145224193 }

local function tcmp(a, b)
	if a[1] ~= b[1] then
		return a[1] < b[1] and -1 or 1
	end
	if a[2] ~= b[2] then
		return a[2] < b[2] and -1 or 1
	end
	return 0
end

-- A decimal int64, or nil.
local function readint(s)
	local neg = string.sub(s, 1, 1) == "-"
	local d = neg and string.sub(s, 2) or s
	local n = #d
	if n == 0 or n > 19 or string.find(d, "%D") then
		return nil
	end
	local h = n > 9 and tonumber(string.sub(d, 1, n - 9)) or 0
	local l = tonumber(string.sub(d, n > 9 and n - 8 or 1))
	local t
	if not neg then
		t = { h, l }
	elseif l == 0 then
		t = { -h, 0 }
	else
		t = { -h - 1, BIL - l }
	end
	if tcmp(t, TMIN) < 0 or tcmp(t, TMAX) > 0 then
		return nil
	end
	return t
end

local function tshow(t)
	local h, l = t[1], t[2]
	if h == 0 then
		return format("%.0f", l)
	elseif h > 0 then
		return format("%.0f%09.0f", h, l)
	elseif l == 0 then
		return format("-%.0f000000000", -h)
	end
	h, l = -h - 1, BIL - l
	if h == 0 then
		return format("-%.0f", l)
	end
	return format("-%.0f%09.0f", h, l)
end

-- a - b in ns for a >= b, or nil at 2^53 or more.
local function tdiff_small(a, b)
	local h, l = a[1] - b[1], a[2] - b[2]
	if l < 0 then
		h, l = h - 1, l + BIL
	end
	if h < 9007198 then
		return h * BIL + l
	end
	return nil
end

-- The time h * 10^9 + l for 0 <= l < 2 * 10^9, or nil at or past INT64_MAX (never).
local function tmake(h, l)
	if l >= BIL then
		h, l = h + 1, l - BIL
	end
	local v = { h, l }
	if tcmp(v, TMAX) >= 0 then
		return nil
	end
	return v
end

-- t + w ns for a double w, or nil at or past INT64_MAX (never).
local function tadd_small(t, w)
	local r = fmod(w, BIL)
	return tmake(t[1] + (w - r) / BIL, t[2] + r)
end

local now
if tm then
	now = { tonumber(tm[1]), tonumber(tm[2]) * 1000 }
else
	now = readint(ARGV[2])
	if now == nil then
		return bad("now")
	end
	-- INT64_MIN and INT64_MAX are no times: they read as their neighbours.
	if tcmp(now, TMIN) == 0 then
		now = TMIN1
	elseif tcmp(now, TMAX) == 0 then
		now = { TMAX[1], TMAX[2] - 1 }
	end
end

-- ---- The general path: limbs where needed --------------------------------------

local B = 16777216 -- 2^24

local function norm(a)
	local n = #a
	while n > 0 and a[n] == 0 do
		a[n] = nil
		n = n - 1
	end
	return a
end

-- An integer-valued double >= 0 into limbs (division by 2^24 is exact).
local function fromnum(x)
	local r, i = {}, 1
	while x > 0 do
		local h = floor(x / B)
		r[i] = x - h * B
		x = h
		i = i + 1
	end
	return r
end

-- The value as a double: exact below 2^53, an estimate above.
local function tonum(a)
	local v = 0
	for i = #a, 1, -1 do
		v = v * B + a[i]
	end
	return v
end

local function cmp(a, b)
	local na, nb = #a, #b
	if na ~= nb then
		return na < nb and -1 or 1
	end
	for i = na, 1, -1 do
		local x, y = a[i], b[i]
		if x ~= y then
			return x < y and -1 or 1
		end
	end
	return 0
end

local function add(a, b)
	local r, c = {}, 0
	local n = #a > #b and #a or #b
	for i = 1, n do
		local s = (a[i] or 0) + (b[i] or 0) + c
		c = s >= B and 1 or 0
		r[i] = s - c * B
	end
	if c > 0 then
		r[n + 1] = c
	end
	return r
end

-- a - b for a >= b.
local function sub(a, b)
	local r, c = {}, 0
	for i = 1, #a do
		local s = a[i] - (b[i] or 0) - c
		c = s < 0 and 1 or 0
		r[i] = s + c * B
	end
	return norm(r)
end

local function mul(a, b)
	local na, nb = #a, #b
	if na == 0 or nb == 0 then
		return {}
	end
	local r = {}
	for i = 1, na + nb do
		r[i] = 0
	end
	for i = 1, na do
		local x, c = a[i], 0
		if x ~= 0 then
			for j = 1, nb do
				-- < 2^24 + (2^24 - 1)^2 + 2^25: exact
				local t = r[i + j - 1] + x * b[j] + c
				c = floor(t / B)
				r[i + j - 1] = t - c * B
			end
			local k = i + nb
			while c > 0 do
				local t = r[k] + c
				c = floor(t / B)
				r[k] = t - c * B
				k = k + 1
			end
		end
	end
	return norm(r)
end

-- Quotient and remainder, b > 0.  A one-limb divisor is a short division
-- (each step divides less than 2^48).  Otherwise each round subtracts a
-- quotient estimate from doubles shrunk by 2^-40, more than their error
-- (< 2^-48), so it never overshoots; every round leaves at most 2^-40 of the
-- quotient plus one, so a 128-bit quotient takes a handful of rounds.
local function divmod(a, b)
	if cmp(a, b) < 0 then
		return {}, a
	end
	if #b == 1 then
		local d, q, r = b[1], {}, 0
		for i = #a, 1, -1 do
			local t = r * B + a[i]
			local qi = floor(t / d)
			r = t - qi * d
			if r < 0 then
				qi, r = qi - 1, r + d
			end
			q[i] = qi
		end
		return norm(q), (r == 0 and {} or { r })
	end
	local q, r, bd = {}, a, tonum(b)
	while cmp(r, b) >= 0 do
		local e = floor(tonum(r) / bd * (1 - 2 ^ -40))
		if e < 1 then
			e = 1
		end
		local el = fromnum(e)
		r = sub(r, mul(el, b))
		q = add(q, el)
	end
	return q, r
end

-- Decimal digits (1 to 20 of them) into limbs.
local function parse(s)
	local first = (#s - 1) % 6 + 1
	local r = fromnum(tonumber(string.sub(s, 1, first)))
	for i = first + 1, #s, 6 do
		local c = tonumber(string.sub(s, i, i + 5))
		for j = 1, #r do
			local t = r[j] * 1000000 + c
			c = floor(t / B)
			r[j] = t - c * B
		end
		if c > 0 then
			r[#r + 1] = c
		end
	end
	return r
end

local function tostr(a)
	local parts, x = {}, a
	while #x > 0 do
		local q, r = {}, 0
		for i = #x, 1, -1 do
			local t = r * B + x[i]
			local qi = floor(t / 1000000)
			q[i] = qi
			r = t - qi * 1000000
		end
		x = norm(q)
		parts[#parts + 1] = r
	end
	local s = string.format("%.0f", parts[#parts] or 0)
	for i = #parts - 1, 1, -1 do
		s = s .. string.format("%06.0f", parts[i])
	end
	return s
end

-- ---- Numbers: a double below 2^53, limbs at or above ------------------------
-- Every operation on two doubles checks that its exact result stays below
-- 2^53 (rounding is monotonic, so a rounded result below 2^53 was exact);
-- otherwise it redoes the work in limbs.  Most calls never leave doubles.

local function L(a)
	if type(a) == "number" then
		return fromnum(a)
	end
	return a
end

local function N(a)
	local n = #a
	if n <= 2 or (n == 3 and a[3] < 32) then
		return tonum(a)
	end
	return a
end

-- x: the result in doubles (false if an operand is limbs); f: the same on limbs.
local function exact(x, a, b, f)
	if x and x < LIM then
		return x
	end
	return N(f(L(a), L(b)))
end

local function padd(a, b)
	return exact(type(a) == "number" and type(b) == "number" and a + b, a, b, add)
end

-- a - b for a >= b
local function psub(a, b)
	return exact(type(a) == "number" and type(b) == "number" and a - b, a, b, sub)
end

local function pmul(a, b)
	return exact(type(a) == "number" and type(b) == "number" and a * b, a, b, mul)
end

local function pcmp(a, b)
	if type(a) == "number" and type(b) == "number" then
		return a < b and -1 or (a > b and 1 or 0)
	end
	return cmp(L(a), L(b))
end

-- fmod is exact, and so is (a - r) / b, a whole quotient below 2^53.
local function pdivmod(a, b)
	if type(a) == "number" and type(b) == "number" then
		local r = math.fmod(a, b)
		return (a - r) / b, r
	end
	local q, r = divmod(L(a), L(b))
	return N(q), N(r)
end

local function pdivceil(a, b)
	local q, r = pdivmod(a, b)
	if r ~= 0 then
		q = padd(q, 1)
	end
	return q
end

local function pstr(a)
	if type(a) == "number" then
		return string.format("%.0f", a)
	end
	return tostr(a)
end

-- At most 20 digits and at most hi (limbs), or nil.
local function unsigned(s, hi)
	local n = #s
	if n == 0 or n > 20 or string.find(s, "%D") then
		return nil
	end
	if n <= 15 then
		return tonumber(s)
	end
	local v = parse(s)
	if cmp(v, hi) > 0 then
		return nil
	end
	return N(v)
end

local U64MAX = { 16777215, 16777215, 65535 } -- 2^64 - 1
local T63 = { 0, 0, 32768 }                  -- 2^63
local Q_MAX = { 16777215, 16777215, 32767 }  -- 2^63 - 1
local T62 = { 0, 0, 16384 }                  -- 2^62: the largest burst
local DEBT_MAX = { 16777215, 16777215, 16383 } -- 2^62 - 1

-- a - b in ns, for a >= b.
local function tdiff(a, b)
	local d = tdiff_small(a, b)
	if d then
		return d
	end
	local h, l = a[1] - b[1], a[2] - b[2]
	if l < 0 then
		h, l = h - 1, l + BIL
	end
	return N(add(mul(fromnum(h), fromnum(BIL)), fromnum(l)))
end

-- t + w ns, or nil at or past INT64_MAX (never).
local function tadd(t, w)
	if type(w) == "number" then
		return tadd_small(t, w)
	end
	if #w > 3 then
		return nil
	end
	local ql, rl = divmod(w, fromnum(BIL))
	local q, r = N(ql), N(rl)
	if type(q) ~= "number" then
		return nil
	end
	return tmake(t[1] + q, t[2] + r)
end

-- The bucket being decided: its clock, whole tokens and debt (one of them
-- 0), the fraction rem/sq, the rate sp per sq and the burst sb.
local clock, tok, debt, rem, sp, sq, sb
-- Its lease groups, expiry ascending, each after clock: { expiry, count }
-- (docs/leases.md, "Safety"); none for a "tb1" value.
local gs = {}

-- What production may fill the level to: burst less what live leases hold.
local function top()
	local o = 0
	for i = 1, #gs do
		o = padd(o, gs[i][2])
	end
	if pcmp(o, sb) >= 0 then
		return 0
	end
	return psub(sb, o)
end

-- Adds k tokens, paying debt first, within top(); a level already above
-- it is not cut, only not filled.
local function credit(k)
	if debt ~= 0 then
		if pcmp(k, debt) <= 0 then
			debt = psub(debt, k)
			return
		end
		k, debt = psub(k, debt), 0
	end
	local cap = top()
	if pcmp(tok, cap) >= 0 then
		return
	end
	if pcmp(k, psub(cap, tok)) < 0 then
		tok = padd(tok, k)
	else
		tok = cap
	end
end

-- Credits what the rate produced from clock to t: ((t - clock) p + rem) / q
-- whole tokens, the remainder carried.  An earlier t changes nothing.
local function produce(t)
	if tcmp(t, clock) <= 0 then
		return
	end
	if sp ~= 0 then
		local k
		k, rem = pdivmod(padd(pmul(tdiff(t, clock), sp), rem), sq)
		if k ~= 0 then
			credit(k)
		end
	end
	clock = t
end

-- produce() in pieces: up to each lease group's expiry under the cap in
-- force, the group dropped there.  The pieces produce what one span would.
local function advance(t)
	while #gs > 0 and tcmp(gs[1][1], t) <= 0 do
		produce(gs[1][1])
		table.remove(gs, 1)
	end
	produce(t)
end

-- The first time >= clock when d more tokens are produced, or nil (never):
-- the least w with w p >= d q - rem.
local function covered(d)
	if sp == 0 then
		return nil
	end
	return tadd(clock, pdivceil(psub(pmul(d, sq), rem), sp))
end

-- Reconfigures the bucket at now to p per q and burst, as set_rate_every_at
-- and then set_burst_at would; true if anything changed.
local function reconfigure(p, q, burst)
	local reconf = false
	if pcmp(pmul(p, sq), pmul(sp, q)) ~= 0 then
		advance(now)
		if p ~= 0 and sp ~= 0 then
			-- The old fraction carries, rounded down to a nanosecond of the new
			-- rate, and reaches no further back than INT64_MIN + 1.
			local carry = pdivmod(pmul(rem, q), pmul(sq, p))
			local room = tdiff(clock, TMIN1)
			if pcmp(carry, room) > 0 then
				carry = room
			end
			rem = pmul(carry, p)
		else
			rem = 0
		end
		sp, sq, reconf = p, q, true
	end
	if pcmp(burst, sb) ~= 0 then
		advance(now)
		sb, reconf = burst, true
		if pcmp(tok, sb) > 0 then
			tok = sb
		end
	end
	return reconf
end

-- ---- allow_all: several limits in one key, all or nothing (1.2) ---------------
-- ARGV: "allow_all", now, n, then tokens period burst for each of 1 to 16
-- limits.  The stored value is
--   "tbs1 clock" then " level rem tokens period burst" for each limit,
-- decimal, the limits in the call's order, one clock for all of them
-- (every limit of a key has seen every call's time), no debt (nothing but
-- allow_all writes it, and an allow never borrows).  The single-limit ops
-- find no "tb1" there and refuse it (TBCORRUPT), as allow_all refuses a
-- "tb1" value: a key holds one kind or the other.  Each limit i is decided
-- as the single allow decides it, reconfigured the same way when its
-- configuration differs; a call naming more limits than are stored adds
-- them full, one naming fewer drops the rest.  n is taken from every limit
-- or from none.
-- Reply: { code, index, clock, level, act, full }: code 1 taken, 0 refused,
-- 2 n above limit index's burst (nothing read or written); index (from 0)
-- the limit refused, the lowest one short of n, or if taken the one with
-- the fewest whole tokens left (the lowest of those); the key's clock;
-- level: that limit's whole tokens; act: when every limit holds n (the
-- latest of them; the clock if taken); full: when every limit is full
-- again; times as in the single reply.  With a last argument "1", the
-- common case may reply instead { code, index, level, wait, full_wait } in
-- integers, the waits in ns from the clock; callers tell the two apart by
-- their length, as for allow.
local function allow_all()
	local count = (nargs - 3) / 3
	local n = unsigned(ARGV[3], U64MAX)
	if n == nil then
		return bad("n")
	end
	local cfg = {}
	for i = 1, count do
		local j = 3 * i + 1
		local p, q = unsigned(ARGV[j], U64MAX), unsigned(ARGV[j + 1], Q_MAX)
		if p == nil or q == nil or (p ~= 0 and q == 0) then
			return bad("rate")
		end
		if p == 0 then
			q = 1
		end
		local b = unsigned(ARGV[j + 2], T62)
		if b == nil then
			return bad("burst or n")
		end
		cfg[i] = { p, q, b }
	end
	for i = 1, count do
		if pcmp(n, cfg[i][3]) > 0 then
			return { 2, i - 1, tshow(now), "0", NEVER, NEVER }
		end
	end
	-- The stored limits, checked as the single path checks a bucket.
	local st, clock0 = {}, now
	if stored then
		local f, pos, len = {}, 6, #stored
		if string.sub(stored, 1, 5) ~= "tbs1 " then
			f = nil
		end
		while f do
			local a, b = find(stored, "^%-?%d+", pos)
			if not a or #f > 80 then
				f = nil
				break
			end
			f[#f + 1] = string.sub(stored, a, b)
			if b == len then
				break
			end
			if string.sub(stored, b + 1, b + 1) ~= " " then
				f = nil
				break
			end
			pos = b + 2
		end
		local m = f and (#f - 1) / 5
		clock0 = f and readint(f[1])
		if not m or m < 1 or m > 16 or m % 1 ~= 0 or not clock0 or tcmp(clock0, TMIN) == 0
			or tcmp(clock0, TMAX) == 0 then
			return redis.error_reply("TBCORRUPT the value at this key is not a set of token buckets")
		end
		for i = 1, m do
			local o = 5 * i - 3
			local l, r = unsigned(f[o], T62), unsigned(f[o + 1], U64MAX)
			local a, b, u = unsigned(f[o + 2], U64MAX), unsigned(f[o + 3], Q_MAX), unsigned(f[o + 4], T62)
			if not (l and r and a and b and u) or b == 0 or (a == 0 and b ~= 1) or pcmp(r, b) >= 0
				or pcmp(l, u) > 0 then
				return redis.error_reply("TBCORRUPT the value at this key is not a set of token buckets")
			end
			st[i] = { l, r, a, b, u }
		end
	end
	-- Each limit at max(now, clock), reconfigured as the call says.
	local reconf, short = not stored or #st ~= count, nil
	local out = {}
	for i = 1, count do
		local c, s = cfg[i], st[i]
		clock, debt = clock0, 0
		if s then
			tok, rem, sp, sq, sb = s[1], s[2], s[3], s[4], s[5]
		else
			-- A limit not stored yet is full.
			tok, rem, sp, sq, sb = c[3], 0, c[1], c[2], c[3]
		end
		if reconfigure(c[1], c[2], c[3]) then
			reconf = true
		end
		advance(now)
		if not short and pcmp(tok, n) < 0 then
			short = i
		end
		out[i] = { tok, rem, sp, sq, sb }
	end
	-- Taken from all, or from none; then the report.
	local code, index, fewest, act, full = short and 0 or 1, short, nil, clock, clock
	for i = 1, count do
		local o = out[i]
		tok, rem, sp, sq, sb = o[1], o[2], o[3], o[4], o[5]
		if not short then
			tok = psub(tok, n)
			o[1] = tok
			if not fewest or pcmp(tok, fewest) < 0 then
				index, fewest = i, tok
			end
		elseif act and pcmp(tok, n) < 0 then
			-- nil: never, the latest of all
			local t = covered(psub(n, tok))
			if not t or tcmp(t, act) > 0 then
				act = t
			end
		end
		if full and pcmp(tok, sb) < 0 then
			local t = covered(psub(sb, tok))
			if not t or tcmp(t, full) > 0 then
				full = t
			end
		end
	end
	-- A refusal on the server's clock with the stored configuration writes
	-- nothing, as the single allow's: every limit's production from the
	-- stored clock on is what it would be from this one.
	if not short or not tm or reconf then
		local parts = { "tbs1", tshow(clock) }
		for i = 1, count do
			local o = out[i]
			parts[#parts + 1] = table.concat({ pstr(o[1]), pstr(o[2]), pstr(o[3]), pstr(o[4]), pstr(o[5]) }, " ")
		end
		local value = table.concat(parts, " ")
		local ms = full and tm and pdivceil(tdiff(full, clock), 1000000)
		if not ms or type(ms) ~= "number" or ms > 70368744177664 then
			redis.call("SET", key, value)
		else
			redis.call("SET", key, value, "PX", format("%.0f", ms + 1000))
		end
	end
	return { code, index - 1, tshow(clock), pstr(out[index][1]), act and tshow(act) or NEVER,
		full and tshow(full) or NEVER }
end
if several then
	return allow_all()
end

-- ---- Lease groups (the "tbl1" value) ---------------------------------------------
-- "tbl1 clock level rem p q burst" then " expiry count" for each of 1 to 4
-- groups, expiry ascending: tokens leases took, usable until the expiry
-- (tokenbucket-redis(7), docs/leases.md "Safety").  Production and every
-- op fill the level only up to burst less the live groups' counts.

-- The text after a value's burst into gs, checked: nothing for "tb1",
-- 1 to 4 pairs for "tbl1", expiries strictly ascending and neither
-- INT64_MIN nor INT64_MAX, counts 1 to 2^62; false otherwise.
local function read_groups(kind, more)
	gs = {}
	if kind == "tb1" then
		return more == ""
	end
	local pos, prev = 1, nil
	while pos <= #more do
		local _, b, e, c = find(more, "^ (%-?%d+) (%d+)", pos)
		if not b or #gs == 4 then
			return false
		end
		e, c = readint(e), unsigned(c, T62)
		if not e or not c or c == 0 or tcmp(e, TMIN) == 0 or tcmp(e, TMAX) == 0
			or (prev and tcmp(e, prev) <= 0) then
			return false
		end
		gs[#gs + 1], prev, pos = { e, c }, e, b + 1
	end
	return #gs > 0
end

-- Drops the groups expired by the stored clock; true (for the checks' chain).
local function live_groups()
	while #gs > 0 and tcmp(gs[1][1], clock) <= 0 do
		table.remove(gs, 1)
	end
	return true
end

-- A lease's grant of n (taken from the level already) into a group: the
-- latest if it lives half a window more, else a new one living a window
-- (then the latest), else with 4 taken the latest.  Groups never move, so
-- a chunk stays in the group it was told.  Returns the group's expiry.
local function lease_take(n, w)
	local half = tadd_small(clock, floor(w / 2)) or { TMAX[1], TMAX[2] - 1 }
	local k = #gs
	if k == 0 or (tcmp(gs[k][1], half) < 0 and k < 4) then
		k = k + 1
		gs[k] = { tadd_small(clock, w) or { TMAX[1], TMAX[2] - 1 }, 0 }
	end
	gs[k][2] = padd(gs[k][2], n)
	return gs[k][1]
end

-- A give-back of n naming the group of expiry e: that group, if it lives,
-- is lowered by n (to 0 at most, and then dropped).
local function give_group(e, n)
	for i = 1, #gs do
		if tcmp(gs[i][1], e) == 0 then
			if pcmp(n, gs[i][2]) >= 0 then
				table.remove(gs, i)
			else
				gs[i][2] = psub(gs[i][2], n)
			end
			return
		end
	end
end

-- When the bucket is full again: its level filled to burst once every
-- group has expired, production capped on the way; nil: never.
local function full_at()
	local c0, t0, d0, r0, g0 = clock, tok, debt, rem, gs
	if #gs > 0 then
		gs = {}
		for i = 1, #g0 do
			gs[i] = g0[i]
		end
		advance(g0[#g0][1])
	end
	local missing = padd(psub(sb, tok), debt)
	local full = missing == 0 and clock or covered(missing)
	clock, tok, debt, rem, gs = c0, t0, d0, r0, g0
	return full
end

-- The groups as the value's tail.
local function groups_text()
	local t = {}
	for i = 1, #gs do
		t[i] = " " .. tshow(gs[i][1]) .. " " .. pstr(gs[i][2])
	end
	return table.concat(t)
end

-- The configuration: p tokens per q ns (p 0: rate 0, kept as 0 per 1).
local p, q = unsigned(ARGV[3], U64MAX), unsigned(ARGV[4], Q_MAX)
if p == nil or q == nil or (p ~= 0 and q == 0) then
	return bad("rate")
end
if p == 0 then
	q = 1
end
local burst = unsigned(ARGV[5], T62)
local n = unsigned(ARGV[6], U64MAX)
if burst == nil or n == nil then
	return bad("burst or n")
end
-- reserve: max_wait; cancel: time_to_act.  Both int64.
local arg
if op == "reserve" or op == "cancel" then
	arg = readint(ARGV[7])
	if arg == nil then
		return bad(op == "reserve" and "max_wait" or "time_to_act")
	end
end
if op == "reset" and pcmp(n, burst) > 0 then
	return bad("reset level")
end
-- lease: the window in ns, 1 to a day; giveback: the group's expiry.
if op == "lease" then
	arg = readint(ARGV[7])
	if arg == nil or arg[1] < 0 or (arg[1] == 0 and arg[2] == 0) or tcmp(arg, { 86400, 0 }) > 0 then
		return bad("window")
	end
	arg = arg[1] * BIL + arg[2]
elseif op == "giveback" then
	arg = readint(ARGV[7])
	if arg == nil then
		return bad("group")
	end
end

-- The stored state: "tb1 clock level rem p q burst", decimal, level negative
-- in debt.  Kept as tok (whole tokens) and debt, one of them 0.  A value
-- that is not exactly that, or breaks an invariant, is refused, never
-- repaired.
if stored then
	local kind, c, neg, l, r, a, b, u, more = string.match(stored,
		"^(tbl?1) (%-?%d+) (%-?)(%d+) (%d+) (%d+) (%d+) (%d+)(.*)$")
	if kind and not read_groups(kind, more) then
		kind = nil
	end
	if kind then
		clock = readint(c)
		rem, sp, sq, sb = unsigned(r, U64MAX), unsigned(a, U64MAX), unsigned(b, Q_MAX), unsigned(u, T62)
		if neg == "-" then
			tok, debt = 0, unsigned(l, DEBT_MAX)
		else
			tok, debt = unsigned(l, T62), 0
		end
	end
	if not (clock and tok and debt and rem and sp and sq and sb) or tcmp(clock, TMIN) == 0
		or tcmp(clock, TMAX) == 0 or sq == 0 or (sp == 0 and sq ~= 1)
		or pcmp(rem, sq) >= 0 or pcmp(tok, sb) > 0 or not live_groups() then
		return redis.error_reply("TBCORRUPT the value at this key is not a token bucket")
	end
else
	-- A new bucket is full and sees its first time now.
	clock, tok, debt, rem, sp, sq, sb = now, burst, 0, 0, p, q, burst
end

-- A call whose configuration differs reconfigures the bucket at now.
local reconf = reconfigure(p, q, burst)
local changed = reconf
local code, act, enough, gexp = 1, nil, nil, nil
if op == "allow" or op == "reserve" or op == "lease" then
	if pcmp(n, sb) > 0 then
		code = 2
	else
		advance(now)
		changed = true
		enough = debt == 0 and pcmp(tok, n) >= 0
		if op ~= "reserve" then
			if enough then
				tok, act = psub(tok, n), clock
			else
				code, act = 0, covered(padd(psub(n, tok), debt))
			end
			gexp = clock
			if op == "lease" and enough and n ~= 0 then
				gexp = lease_take(n, arg)
			end
		else
			-- The debt after taking n; then when it is paid.
			local d = enough and 0 or padd(psub(n, tok), debt)
			if pcmp(d, DEBT_MAX) > 0 then
				code = 3
			else
				act = clock
				if d ~= 0 then
					act = covered(d)
				end
				-- max_wait INT64_MAX is no limit; no wait is short enough
				-- for a negative one.
				local ok = tcmp(arg, TMAX) == 0
				if not ok and act ~= nil and arg[1] >= 0 then
					ok = pcmp(tdiff(act, clock), tdiff(arg, { 0, 0 })) <= 0
				end
				if not ok then
					code = 0
				elseif enough then
					tok = psub(tok, n)
				else
					tok, debt = 0, d
				end
			end
		end
	end
elseif op == "cancel" then
	if n ~= 0 then
		advance(now)
		changed = true
		if tcmp(clock, arg) <= 0 then
			credit(n)
		end
	end
elseif op == "refund" then
	-- Tokens taken earlier (a lease's unused part) come back at now,
	-- paying debt first, within burst: tokenbucket_refund at the bucket's
	-- time.  The script cannot tell whose tokens they are; it refuses
	-- more than a burst, which no lease exceeds, and changes nothing then.
	if pcmp(n, sb) > 0 then
		code = 2
	else
		advance(now)
		changed = true
		if n ~= 0 then
			credit(n)
		end
	end
elseif op == "giveback" then
	-- As refund, the named group first lowered by what comes back.
	if pcmp(n, sb) > 0 then
		code = 2
	else
		advance(now)
		changed = true
		give_group(arg, n)
		credit(n)
	end
elseif op == "tokens" then
	advance(now)
	changed = true
else -- reset: the clock becomes now, even if earlier; the level whatever leases hold
	clock, rem, tok, debt, changed, gs = now, 0, n, 0, true, {}
end

-- The bucket is full again at "full"; it expires a second after that, as a
-- full bucket and a missing key are the same.  One that never fills stays,
-- and so does one written at the caller's time: its nanoseconds need not
-- be the server's, and a key that vanished would forget its clock.
--
-- A refusal for want of tokens on the server's clock, with the key's
-- configuration, writes nothing: it took nothing and moved only the clock,
-- below burst (a bucket holding n would have granted), so production from
-- the stored clock to any later time is what it would have been from this
-- one, the time it is full again is unchanged, and so is its expiry.  Only
-- a server clock stepped back sees the difference: the stored clock still
-- never goes back and no token is produced twice, but until the clock is
-- past this call again the bucket holds what it held at the earlier time,
-- less, never more (an allow decides alike; a reserve may wait longer).
local full = full_at()
if tm and stored and not reconf and (code == 3 or (code == 0 and not enough)) then
	changed = false
end
if changed then
	local value = table.concat({ #gs > 0 and "tbl1" or "tb1", tshow(clock),
		(debt ~= 0 and "-" .. pstr(debt) or pstr(tok)), pstr(rem), pstr(sp), pstr(sq), pstr(sb) }, " ")
		.. groups_text()
	local ms = full and tm and pdivceil(tdiff(full, clock), 1000000)
	if not ms or type(ms) ~= "number" or ms > 70368744177664 then
		redis.call("SET", key, value) -- never full, the caller's time, or not for 2^46 ms
	else
		redis.call("SET", key, value, "PX", string.format("%.0f", ms + 1000))
	end
end
local reply = { code, tshow(clock), (debt ~= 0 and "-" .. pstr(debt) or pstr(tok)), pstr(rem), pstr(sq),
	act and tshow(act) or NEVER, full and tshow(full) or NEVER }
if op == "lease" then
	reply[8] = tshow(gexp or clock)
end
return reply
