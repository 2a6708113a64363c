"""The job store's Lua scripts (services/common/jobs.py runs them; nothing else does): each reads
and changes job records in one atomic step, or reads many in one round trip."""

# Applies a state change unless the job is missing (-1), finished (0), or the change would
# send it back to QUEUED (0). Atomic, so a cancel and a success cannot both win; the change's
# JobEvent goes on the job's event log (KEYS[3]) in the same step: ARGV[6] is its MAXLEN, ARGV[7..]
# its fields and values (services/common/events.py).
SET_STATE = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return -1 end
if state == 'JOB_STATE_SUCCEEDED' or state == 'JOB_STATE_FAILED' or state == 'JOB_STATE_CANCELLED' then
  return 0
end
if ARGV[1] == 'JOB_STATE_QUEUED' and state ~= 'JOB_STATE_QUEUED' then return 0 end
redis.call('HSET', KEYS[1], 'state', ARGV[1], 'reason', ARGV[2], 'updated_at', ARGV[3])
if ARGV[4] == '1' then redis.call('SREM', KEYS[2], ARGV[5]) end
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[6], '*', unpack(ARGV, 7))
return 1
"""

# Raises policy_version and step (never lowers them: handles may be re-delivered).
PROGRESS = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local version = tonumber(redis.call('HGET', KEYS[1], 'policy_version') or '0')
if tonumber(ARGV[1]) < version then return 0 end
redis.call('HSET', KEYS[1], 'policy_version', ARGV[1], 'step', ARGV[2], 'updated_at', ARGV[3])
return 1
"""

# Acks a control-stream (or dead-letter) entry and adds its dropped groups to the job's count,
# in one step:
# only the call that acks the entry counts it, so a redelivered entry is never counted twice
# and an entry is never acked uncounted. Returns {counted (0/1), total}; -1 for a missing job.
COUNT_DROPPED = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if redis.call('XACK', KEYS[2], ARGV[1], ARGV[2]) == 0 then
  return {0, tonumber(redis.call('HGET', KEYS[1], 'dropped_groups') or '0')}
end
local total = redis.call('HINCRBY', KEYS[1], 'dropped_groups', ARGV[3])
redis.call('HSET', KEYS[1], 'updated_at', ARGV[4])
return {1, total}
"""


# The fields ARGV of every hash in KEYS, as one flat list (nil for a missing field or hash).
HMGET_MANY = """
local out = {}
for _, key in ipairs(KEYS) do
  local values = redis.call('HMGET', key, unpack(ARGV))
  for j = 1, #ARGV do out[#out + 1] = values[j] end
end
return out
"""

# KEYS in threes, one per job: its hash, checkpoints stream and status stream. Returns, per job,
# its state, submitted_at, and the two streams' total length (how often its trainer has spoken).
OVERVIEW = """
local out = {}
for i = 1, #KEYS, 3 do
  local fields = redis.call('HMGET', KEYS[i], 'state', 'submitted_at')
  out[#out + 1] = fields[1]
  out[#out + 1] = fields[2]
  out[#out + 1] = redis.call('XLEN', KEYS[i + 1]) + redis.call('XLEN', KEYS[i + 2])
end
return out
"""


# A digest of the newest ARGV[1] jobs of the index KEYS[1]: their ids and updated_at (every write
# of a record sets it), so a list of them is unchanged while its digest is. ARGV[2] is the
# hashes' key prefix (one Redis, not a cluster: the keys are made here, not passed).
LIST_DIGEST = """
local ids = redis.call('ZREVRANGE', KEYS[1], 0, tonumber(ARGV[1]) - 1)
local parts = {}
for i, id in ipairs(ids) do
  parts[i] = id .. '=' .. (redis.call('HGET', ARGV[2] .. id, 'updated_at') or '')
end
return redis.sha1hex(table.concat(parts, ','))
"""
