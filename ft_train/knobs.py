"""ft-train's own waits and bounds, in one place, each with why it has its value.

What a user chooses is in the configs (`config.py`); these are the implementation's. Modules
read them at use time (`knobs.X`), so a test can set one here for the whole library.
"""

# -- on the ranks ----------------------------------------------------------------------------

# A rank's reports go to the driver as one Dask event this often (a checkpoint's at once): each
# event costs the scheduler and the driver their own handling; the journal keeps what a commit
# needs meanwhile (bench/README.md has the figures).
REPORT_BATCH_S = 0.5
# An agreement starts at most this many reports after the previous one, whatever their pace.
AGREE_EVERY_MAX = 16
# A group stopped by the driver (a resize) gives its pending uploads this long to finish, so the
# rounds they complete can still be committed; the rest are dropped.
STOP_FLUSH_S = 10.0
# A rank that failed (its own error or a peer's) gives them this long: less than STOP_GRACE_S.
FAIL_FLUSH_S = 2.0
# Asynchronous uploads pending at once: one uploading, one waiting absorbs a slow upload without
# holding the rank; report() waits beyond that.
MAX_IN_FLIGHT_UPLOADS = 2
# Remote checkpoints kept in a node's download cache beyond those in use: the latest, and the
# one a damaged latest falls back to.
DOWNLOAD_CACHE_KEEP = 2
# In-memory snapshot pieces a holder keeps per (run, rank): the newest round, and the one before
# it, which is complete when a rank dies while the newest is still on its way.
SNAPSHOTS_PER_RANK = 2
# A snapshot piece's send (or fetch) to a holder that does not answer by then is given up: the
# round is not held, and the run falls back to an older one, or to storage.
SNAPSHOT_SEND_TIMEOUT_S = 10.0

# -- on the driver ---------------------------------------------------------------------------

# The other ranks of a failed group get this long to fail on their own (gloo sees a dead peer at
# once) before their processes are killed. GPU ranks are killed at once: NCCL may not notice,
# and a CUDA context is not to be trusted after a failure.
STOP_GRACE_S = 3.0
# A rank that failed because it lost a peer is judged this long after, so the failure is charged
# to its cause when the cause's own signal (a lost worker, a hung peer) comes in meanwhile.
COLLATERAL_WAIT_S = 2.0
# Workers given notice leave at their deadline; heard nothing by this long after it (a retired
# worker gone without a word), the driver stops the group anyway.
NOTICE_SLACK_S = 1.0
# After every rank returned, their last reports still in flight are awaited this long.
REPORT_DRAIN_TIMEOUT_S = 30.0
# A metrics-only step is logged at most this often.
PROGRESS_LOG_EVERY_S = 10.0
# The metric history is written at a checkpoint's commit at most this often (and always at a
# failure and at the run's end): one small write, not one per checkpoint of a fast run.
HISTORY_SAVE_EVERY_S = 5.0
# The Prefect UI's progress artifact is updated at most this often: each update is an API call
# on the controller's thread (a failure's table is updated at once).
UI_UPDATE_EVERY_S = 2.0
# Its metric history and plot (up to 256 rows, an SVG: the server stores each update whole) at
# most this often, and at each attempt, failure and end: every 2 s they cost the ranks ~1-2 %
# of their steps on 2 cores (bench/README.md).
UI_HISTORY_EVERY_S = 10.0
# A worker that accepts a connection but never answers (its process or machine frozen) would hold
# a group's start, a kill, a recovery or a Ctrl+C until the scheduler drops it: given up on then.
ANSWER_TIMEOUT_S = 5.0
# A worker that does not accept a connection by then is gone already.
KILL_CONNECT_TIMEOUT = "3s"
# Groups in a row that fail before every rank has joined end the run, whatever max_failures
# says: a restart does not fix a rendezvous that cannot work, and -1 would loop for ever.
START_FAILURE_LIMIT = 3
# Warm spare workers a local CPU cluster starts beyond one per rank: a failed rank's place is
# taken at once while its nanny restarts the lost process.
SPARE_WORKERS = 1
# Reports waiting for one user callback (`RunConfig.callbacks`) at most: a callback slower than
# the run's reports loses the oldest beyond this (with a warning), never the controller's time.
# Checkpoints, failures and the end are never dropped: there are few of them.
CALLBACK_QUEUED_REPORTS = 1000
# At the run's end the driver waits this long for the user callbacks to take what is queued (a
# tracker's end status among it), then leaves a callback still busy to itself.
CALLBACK_DRAIN_S = 30.0

# -- the run's lease -------------------------------------------------------------------------

# A holder on another machine that has not renewed for this long is taken over.
LEASE_TTL_S = 30.0
# Renewals per TTL: one every 5 s survives five failed renewals in a row.
LEASE_RENEWALS_PER_TTL = 6

# -- object storage (S3) ---------------------------------------------------------------------

# botocore's attempts at one S3 request (standard mode: exponential backoff with full jitter, a
# random wait up to 1 s, 2 s, 4 s, ... capped at 20 s): 8 attempts ride out an outage of about
# 35 s on average (an endpoint restarting, a load balancer failing over), and one of 5 s all
# but always (1 in 10 000 falls short; with 6 attempts, 1 in 40). Past that the request
# fails: a rank's upload fails its group (a charged failure); a driver's write of the run's
# documents waits for the storage while its lease holds (`RunStore.write`).
S3_RETRY_ATTEMPTS = 8
# A connection to S3 that takes longer than this is refused and retried.
S3_CONNECT_TIMEOUT_S = 5.0
# A request that has sent nothing back for this long is given up and retried.
S3_READ_TIMEOUT_S = 30.0
# A driver's write that storage did not take (unreachable) is tried again after 0.5 s, 1 s, 2 s,
# ... up to this, for as long as its lease holds (LEASE_TTL_S without a renewal).
STORAGE_WAIT_MAX_DELAY_S = 4.0
