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
-- (function-library.sh): the names they use are its names too.  The build
-- writes the script as src/redis/script-*.lua in name order, this file
-- first: its common cases, then the general path.

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
-- allow, reserve, tokens, refund or cancel on a new bucket, or on a stored one whose configuration
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
elseif op ~= "reset" then
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
local common = op ~= "reset" and not several
-- lease and giveback keep lease groups: the general path's alone
if op == "lease" or op == "giveback" then
	common = false
end
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
		-- allow, reserve: when n tokens are there, w ns from t (false:
		-- never), h, lo as a time.  The least w with w p >= d q - rem; fmod
		-- is exact, and so then is the division of what it leaves.  Past
		-- 2^53, d q - rem is (d - 1) q + (q - rem), for muldiv.
		local w, ah, al, code = 0, th, tl, 1
		local d = n - lv
		if op == "tokens" then
			w = false
		elseif op == "refund" or op == "cancel" then
			-- n back at t, paying debt first, within burst (credit below);
			-- cancel only up to the reservation's time_to_act, and a cancel
			-- of nothing moves no clock (the general path's).
			w = false
			if op == "cancel" then
				local h, l = match(ARGV[7], "^([1-9]%d%d%d%d%d%d%d%d%d)(%d%d%d%d%d%d%d%d%d)$")
				if not h or n == 0 then
					break
				end
				h, l = h + 0, l + 0
				if h > 9223372036 or (h == 9223372036 and l > 854775807) then
					break
				end
				if th > h or (th == h and tl > l) then
					n = 0
				end
			end
			lv = lv + n
			if lv > sb then
				lv = sb
			end
		elseif d > 0 then
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
		if op == "allow" then
			if d > 0 then
				code = 0
			end
		elseif op == "reserve" then
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
		if code == 1 and (op == "allow" or op == "reserve") then
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

