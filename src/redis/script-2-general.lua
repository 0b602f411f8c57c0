-- SPDX-License-Identifier: MIT
--
-- The script's second part (the build writes tokenbucket.lua as
-- script-*.lua in name order, function-library.sh --script): the general
-- path, which decides every call the common cases above hand on.

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
