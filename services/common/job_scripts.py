"""The job store's Lua scripts (services/common/jobs.py runs them; nothing else does): each reads
and changes one job's record in one atomic step. A script's keys are one job's (one hash tag), so
it runs on Redis Cluster too."""

# Applies a state change unless the job is missing (-1), finished (0), or the change would
# send it back to QUEUED (0). Atomic, so a cancel and a success cannot both win; the change's
# JobEvent goes on the job's event log (KEYS[2]) in the same step: ARGV[4] is its MAXLEN, ARGV[5..]
# its fields and values (services/common/events.py). Both keys carry the job's hash tag.
SET_STATE = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return -1 end
if state == 'JOB_STATE_SUCCEEDED' or state == 'JOB_STATE_FAILED' or state == 'JOB_STATE_CANCELLED' then
  return 0
end
if ARGV[1] == 'JOB_STATE_QUEUED' and state ~= 'JOB_STATE_QUEUED' then return 0 end
redis.call('HSET', KEYS[1], 'state', ARGV[1], 'reason', ARGV[2], 'updated_at', ARGV[3])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', unpack(ARGV, 5))
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
