"""The guards' shared decisions as Lua scripts, each run atomically in Redis.

What a request sends (admit, release, backlog counts, rate charges and settles) are Lua functions that one
script, ``BATCH``, runs in sequence: a guard sends everything it queued while its previous round trip was on
its way in the next one (guard/state/shared.py), so each decision is still one atomic step and a busy guard
pays one round trip for many. The lease and resync scripts run on their own.

Keys (all under ``PREFIX``):

- ``guards``: sorted set, guard id -> lease expiry (Redis server time, s). A guard renews its lease while it
  runs; one whose lease has expired is dead, and every script that meets it first removes what it held.
- ``ledger``: hash, ``{guard}|{engine}|r`` -> blocks that guard has reserved on that engine, ``...|b`` -> of
  those, the blocks borrowed beyond their tenants' guarantees (guard/pool/gate.py). Per guard, not per
  request: a guard's own ledger is the truth for its requests, and after Redis comes back it writes its
  totals again (``resync``). ``{guard}|epoch`` -> the number of that guard's last resync: a batch that
  names another epoch is refused whole (``"stale"``), so ops written before a resync (a batch that timed out
  and ran late) or into a Redis that lost the guard (restarted empty, or its lease lapsed) change nothing;
  the guard resyncs, then decides again. ``{guard}|alone`` -> 1 while that guard has written its holdings
  but still decides alone (it waits for the guards that were live before an outage to write theirs,
  guard/state/shared.py): it may take up to its share of each engine meanwhile, unseen here, so every
  ``admit`` counts it as holding at least that share.
- ``vtc``: hash, tenant -> its virtual token counter (weighted service / weight), one for every guard.
- ``backlog``: hash, ``{guard}|{tenant}`` -> requests of that tenant queued at that guard.
- ``verdicts``: hash, tenant -> until when (server time) it stands confirmed as a Fill-and-Squeeze attacker;
  the guards that confirmed it extend that while they still do, and every guard refuses it meanwhile.

Invariants: for every engine, the sum of the live guards' ``r`` fields only grows through ``admit``, which
keeps it within the limits the caller read from that engine's telemetry; a dead guard's fields are gone
before any decision counts them; counters only grow (a release may refund part of what its admission
charged for output that was not generated, never more).
"""

from __future__ import annotations

PREFIX = "kvguard:"
KEYS = [PREFIX + name for name in ("guards", "ledger", "vtc", "backlog", "verdicts")]

# Shared by every script: the server's clock, and the removal of dead guards (and of their fields).
_PROLOGUE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local dead = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
if #dead > 0 then
  local is_dead = {}
  for _, g in ipairs(dead) do is_dead[g] = true end
  for _, h in ipairs({KEYS[2], KEYS[4]}) do
    for _, field in ipairs(redis.call('HKEYS', h)) do
      if is_dead[string.match(field, '^([^|]+)|')] then redis.call('HDEL', h, field) end
    end
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
end
"""

# The decisions and updates a request sends, as Lua functions of (guard, a): ``a`` holds the op's arguments
# (1-based, after the guard). ``BATCH`` runs any sequence of them in one script, so one round trip carries
# everything a busy guard queued while the previous one was on its way.

# What the ops read, read once per script and kept up to date by its own writes (nothing else writes while
# a script runs), so that a batch of dozens of ops reads each hash once instead of once per op.
_READS = """
local sums = {}  -- engine -> {reserved, of which borrowed, {guard -> reserved}, {guard alone -> true}}
local counters = {}  -- tenant -> its virtual counter
local queued = nil  -- tenant -> requests queued at any guard
local function ledger_sums(engine)
  if sums[engine] == nil then
    local reserved, lent, by_guard, alone = 0, 0, {}, {}
    local suffix_r, suffix_b = '|' .. engine .. '|r', '|' .. engine .. '|b'
    local fields = redis.call('HGETALL', KEYS[2])
    for i = 1, #fields, 2 do
      local f = fields[i]
      if string.sub(f, -#suffix_r) == suffix_r then
        reserved = reserved + tonumber(fields[i + 1])
        by_guard[string.sub(f, 1, -#suffix_r - 1)] = tonumber(fields[i + 1])
      elseif string.sub(f, -#suffix_b) == suffix_b then lent = lent + tonumber(fields[i + 1])
      elseif string.sub(f, -6) == '|alone' then alone[string.sub(f, 1, -7)] = true end
    end
    sums[engine] = {reserved, lent, by_guard, alone}
  end
  return sums[engine]
end
local function counter(tenant)
  if counters[tenant] == nil then counters[tenant] = tonumber(redis.call('HGET', KEYS[3], tenant) or '0') end
  return counters[tenant]
end
local function set_counter(tenant, c)
  redis.call('HSET', KEYS[3], tenant, tostring(c))
  counters[tenant] = c
end
local function queue_counts()
  if queued == nil then
    queued = {}
    local fields = redis.call('HGETALL', KEYS[4])
    for i = 1, #fields, 2 do
      local tenant = string.match(fields[i], '|(.*)$')
      queued[tenant] = (queued[tenant] or 0) + tonumber(fields[i + 1])
    end
  end
  return queued
end
local function others_on(engine, guard)
  -- what every other live guard holds on ``engine``, by guard (a guard that loses Redis keeps within its
  -- share of what they leave: guard/pool/gate.py ``others``)
  local held = {}
  for g, r in pairs(ledger_sums(engine)[3]) do
    if g ~= guard and r > 0 then held[g] = r end
  end
  return held
end
local live = nil
local function alone_extra(sum, room, guard)
  -- what the guards deciding alone may hold beyond what they wrote: up to their share of ``room`` each
  if next(sum[4]) == nil then return 0 end
  live = live or redis.call('ZCARD', KEYS[1])
  local extra = 0
  for g, _ in pairs(sum[4]) do
    if g ~= guard then extra = extra + math.max(0, room / live - (sum[3][g] or 0)) end
  end
  return extra
end
local function backlogged_min(except)
  -- the lowest counter among tenants queued at any guard, ``except`` left out (nil: nobody is)
  local low = nil
  for tenant, n in pairs(queue_counts()) do
    if tenant ~= except and n > 0 and (low == nil or counter(tenant) < low) then low = counter(tenant) end
  end
  return low
end
"""

# a: engine, tenant, blocks, borrowed, threshold room (safe_utilization * num_blocks minus blocks held outside
# the guards), pool room (num_blocks minus the same), service charged to the tenant's counter (already
# divided by its weight), slack (how far above the lowest backlogged counter the tenant may be and still go
# first). Returns {1, others} admitted, {0, 'fair'} not its turn, {0, 'full', others} no room (``others``: what
# every other guard holds on the engine, {guard: blocks}, ``others_on``). It does not renew the lease:
# only ``RENEW`` does, so a guard whose lease lapsed (its fields removed) learns it there and resyncs.
_ADMIT = """
local function admit(guard, a)
  local engine, tenant = a[1], a[2]
  local blocks, borrowed = tonumber(a[3]), tonumber(a[4])
  local threshold, pool = tonumber(a[5]), tonumber(a[6])
  local low = backlogged_min(tenant)
  if low ~= nil and counter(tenant) > low + tonumber(a[8]) then return {0, 'fair'} end
  local sum = ledger_sums(engine)
  local fits
  if borrowed > 0 then
    fits = sum[1] + alone_extra(sum, threshold, guard) + blocks <= threshold
  else
    fits = sum[1] - sum[2] + alone_extra(sum, threshold, guard) + blocks <= threshold
      and sum[1] + alone_extra(sum, pool, guard) + blocks <= pool
  end
  if not fits then return {0, 'full', others_on(engine, guard)} end
  local field = guard .. '|' .. engine
  redis.call('HINCRBY', KEYS[2], field .. '|r', blocks)
  if borrowed > 0 then redis.call('HINCRBY', KEYS[2], field .. '|b', borrowed) end
  sum[1], sum[2] = sum[1] + blocks, sum[2] + borrowed
  sum[3][guard] = (sum[3][guard] or 0) + blocks
  counters[tenant] = tonumber(redis.call('HINCRBYFLOAT', KEYS[3], tenant, a[7]))
  return {1, others_on(engine, guard)}
end
"""

# a: engine, blocks, borrowed, tenant, service correction (may be negative: output reserved for but not
# generated). Never takes a field below 0 (a field Redis lost, before the guard's resync).
_RELEASE = """
local function release(guard, a)
  local engine, tenant = a[1], a[4]
  local sum = sums[engine]
  for slot, part in ipairs({{'|r', tonumber(a[2])}, {'|b', tonumber(a[3])}}) do
    if part[2] > 0 then
      local field = guard .. '|' .. engine .. part[1]
      local left = redis.call('HINCRBY', KEYS[2], field, -part[2])
      if left <= 0 then redis.call('HDEL', KEYS[2], field) end
      if sum ~= nil then  -- what the field held, at most
        sum[slot] = sum[slot] - part[2] - math.min(left, 0)
        if slot == 1 then sum[3][guard] = math.max(0, left) end
      end
    end
  end
  local delta = tonumber(a[5])
  if delta ~= 0 then set_counter(tenant, math.max(0, counter(tenant) + delta)) end
  return 1
end
"""

# a: tenant, delta (+1 queued, -1 left the queue). A tenant that was queued nowhere is lifted to the lowest
# counter of those queued (VTC: idling banks no credit), over every guard.
_BACKLOG = """
local function backlog(guard, a)
  local tenant, delta = a[1], tonumber(a[2])
  local field = guard .. '|' .. tenant
  local counts = queue_counts()
  if delta > 0 and (counts[tenant] or 0) <= 0 then
    local low = backlogged_min(tenant)
    if low ~= nil and low > counter(tenant) then set_counter(tenant, low) end
  end
  local left = redis.call('HINCRBY', KEYS[4], field, delta)
  if left <= 0 then redis.call('HDEL', KEYS[4], field) end
  counts[tenant] = (counts[tenant] or 0) + delta - math.min(left, 0)
  return 1
end
"""

# ARGV: guard, lease_ttl_s, epoch, expected, then (kind, field, value) triples: the guard's ledger and backlog
# as it knows them, which replace whatever Redis holds for it (after Redis lost it, or at start); from now on
# only batches of this epoch count. Fewer live guards than ``expected``: the guard goes on deciding alone, and
# is marked so (``|alone``). Returns the live guards.
RESYNC = _PROLOGUE + """
local guard = ARGV[1]
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), guard)
for _, h in ipairs({KEYS[2], KEYS[4]}) do
  for _, field in ipairs(redis.call('HKEYS', h)) do
    if string.match(field, '^([^|]+)|') == guard then redis.call('HDEL', h, field) end
  end
end
redis.call('HSET', KEYS[2], guard .. '|epoch', ARGV[3])
for i = 5, #ARGV, 3 do
  local h = ARGV[i] == 'ledger' and KEYS[2] or KEYS[4]
  redis.call('HSET', h, guard .. '|' .. ARGV[i + 1], ARGV[i + 2])
end
local live = redis.call('ZCARD', KEYS[1])
if live < tonumber(ARGV[4]) then redis.call('HSET', KEYS[2], guard .. '|alone', 1) end
return live
"""

# ARGV: guard, lease_ttl_s, epoch. Renews the lease; returns the live guards, whether this one was still known
# at this epoch (0: its lease had lapsed, or Redis lost it: the caller resyncs), and as JSON what the other
# guards hold on each engine ({engine: {guard: blocks}}).
RENEW = _PROLOGUE + """
local known = redis.call('HGET', KEYS[2], ARGV[1] .. '|epoch') == ARGV[3]
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
local others = {}
local fields = redis.call('HGETALL', KEYS[2])
for i = 1, #fields, 2 do
  local g, engine = string.match(fields[i], '^([^|]+)|(.*)|r$')
  if g ~= nil and g ~= ARGV[1] and tonumber(fields[i + 1]) > 0 then
    others[engine] = others[engine] or {}
    others[engine][g] = tonumber(fields[i + 1])
  end
end
return {redis.call('ZCARD', KEYS[1]), known and 1 or 0, cjson.encode(others)}
"""

# ARGV: guard, how long a verdict stands unless extended (s), then the tenants this guard holds confirmed.
# Returns every tenant confirmed by any guard.
VERDICTS = _PROLOGUE + """
for i = 3, #ARGV do redis.call('HSET', KEYS[5], ARGV[i], tostring(now + tonumber(ARGV[2]))) end
local standing = {}
local fields = redis.call('HGETALL', KEYS[5])
for i = 1, #fields, 2 do
  if tonumber(fields[i + 1]) > now then table.insert(standing, fields[i])
  else redis.call('HDEL', KEYS[5], fields[i]) end
end
return standing
"""

# -- rate limits (guard/state/limits.py) ---------------------------------------------------------------------
# One hash per tenant and limit, ``kvguard:ratelimit:{kind}:{tenant}``: Redis server second -> what was charged
# in it (never negative): the sliding minute of guard/admission/limits.py, on the server's clock for every
# guard. An entry counts through the ``window`` whole seconds after its own (limits.WINDOW_S); every write
# renews the key's expiry past its newest entry's, so an idle tenant leaves nothing behind. The windows are per
# tenant, not per guard (their keys are not in ``KEYS``), and a dead guard's charges stay: they were admitted
# requests, which count until they slide out.


def rate_key(tenant: str, kind: str) -> str:
    """The key of ``tenant``'s window for ``kind`` (requests, tokens); tenant names have no ':' (config)."""
    return f"{PREFIX}ratelimit:{kind}:{tenant}"


# a: window, then (key, limit, need) per window of the tenant. Either every window has room for its need and
# each is charged, or none is. Returns {admitted (1|0), the server time (second charged, and its
# microseconds), the window that refused (1-based; 0 when admitted), its wait (s; 'inf': it never fits), then
# per window: used (after the charge when admitted), seconds until it is empty}. Floats travel as strings
# (Redis truncates Lua numbers to integers).
_RATE_CHARGE = """
local function rate_charge(guard, a)
  local second, micros = tonumber(t[1]), tonumber(t[2])
  local window = tonumber(a[1])
  local windows, refused, longest = {}, 0, 0
  for i = 2, #a, 3 do
    local key, limit, need = a[i], tonumber(a[i + 1]), tonumber(a[i + 2])
    local entries, used = {}, 0
    local fields = redis.call('HGETALL', key)
    for j = 1, #fields, 2 do
      local s, amount = tonumber(fields[j]), tonumber(fields[j + 1])
      if s < second - window then redis.call('HDEL', key, fields[j])
      else
        entries[#entries + 1] = {s, amount}
        used = used + amount
      end
    end
    table.sort(entries, function(x, y) return x[1] < y[1] end)
    local wait, excess = 0, used + need - limit
    if excess > 0 and need > limit then wait = math.huge
    elseif excess > 0 then
      -- used > limit - need >= 0: the oldest entries that make up the excess must leave first
      for _, e in ipairs(entries) do
        excess = excess - e[2]
        if excess <= 0 then wait = e[1] + window + 1 - now; break end
      end
    end
    if wait > longest then refused, longest = #windows + 1, wait end  -- the limit that holds it longest
    windows[#windows + 1] = {key = key, need = need, used = used, entries = entries}
  end
  local out = {refused == 0 and 1 or 0, second, micros, refused, tostring(longest)}
  for _, w in ipairs(windows) do
    if refused == 0 and w.need > 0 then
      redis.call('HINCRBY', w.key, second, w.need)
      redis.call('EXPIRE', w.key, window + 2)
      w.used = w.used + w.need
      w.entries[#w.entries + 1] = {second, w.need}
    end
    local newest = nil
    for _, e in ipairs(w.entries) do if e[2] > 0 then newest = e[1] end end
    out[#out + 1] = w.used
    out[#out + 1] = tostring(newest == nil and 0 or math.max(0, newest + window + 1 - now))
  end
  return out
end
"""

# a: window, the server second a charge was made in, then (key, delta) per window: what the request used minus
# what it was charged. While that second is in the window the delta moves its entry (a refund returns at
# once, a surplus counts from the charge's second); after, a refund has nothing left to give back and a
# surplus is charged now. An entry that would go below 0 (Redis lost the charge) is removed instead.
_RATE_SETTLE = """
local function rate_settle(guard, a)
  local second = tonumber(t[1])
  local window, charged = tonumber(a[1]), a[2]
  local in_window = tonumber(charged) >= second - window
  for i = 3, #a, 2 do
    local key, delta = a[i], tonumber(a[i + 1])
    if in_window and delta ~= 0 then
      if redis.call('HINCRBY', key, charged, delta) <= 0 then redis.call('HDEL', key, charged) end
      redis.call('EXPIRE', key, window + 2)
    elseif delta > 0 then
      redis.call('HINCRBY', key, second, delta)
      redis.call('EXPIRE', key, window + 2)
    end
  end
  return 1
end
"""

# The ops a request sends (``SharedState.ask`` and ``send``), by the name the guard gives them.
OPS = ("ADMIT", "RELEASE", "BACKLOG", "RATE_CHARGE", "RATE_SETTLE")

# ARGV: guard, epoch, then the ops as JSON: [[name (one of ``OPS``), [its arguments]], ...]. Runs them in order,
# as one atomic step; returns each op's answer, in order, as JSON, or "stale" (running none) when the guard's
# epoch in Redis is not this one. One argument each way, whatever the batch's size: the caller packs and
# unpacks it in one C call instead of a Python step per argument.
BATCH = _PROLOGUE + """
if redis.call('HGET', KEYS[2], ARGV[1] .. '|epoch') ~= ARGV[2] then return '"stale"' end
""" + _READS + _ADMIT + _RELEASE + _BACKLOG + _RATE_CHARGE + _RATE_SETTLE + """
local ops = {ADMIT = admit, RELEASE = release, BACKLOG = backlog, RATE_CHARGE = rate_charge,
             RATE_SETTLE = rate_settle}
local out = {}
for i, op in ipairs(cjson.decode(ARGV[3])) do out[i] = ops[op[1]](ARGV[1], op[2]) end
return cjson.encode(out)
"""
