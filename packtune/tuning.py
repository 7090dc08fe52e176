"""Every tuning constant of packtune, in one place.

Each trades one cost against another; the figure that chose it is in
docs/design.md ("Tuning constants"). The modules that use a constant import it
from here by name, so a test may still override it on that module.
Operators set behaviour through ``packtune.settings`` (``PACKTUNE_*``); these are
not settings: changing one changes what the benchmarks measure.
"""

from __future__ import annotations

# -- planning packs (packtune.packing, service.planning) ------------------------------------

#: share of a device's free memory that a pack's estimated memory may fill
HEADROOM = 0.9
#: Omnivore's rule: a larger array only where its trial-steps/s gain at least this much (%)
MIN_GAIN_PERCENT = 10
#: spilled arrays (models larger than the device) one pack may hold: they alternate on its
#: device, each in its share of it, one's shard computing while another's is copied in
#: (Hydra's shard alternation); a new one takes an empty device first
SPILL_ALTERNATE = 2
#: packs a device may have outstanding (one running, one waiting), so that each plan uses
#: the newest throughput and memory measurements
QUEUE_DEPTH = 2
#: memory model of a fusion key never probed on a device kind: small, so that its first pack
#: (k <= 2 by the throughput rule) runs and its probe measures the truth
DEFAULT_BASE_BYTES = 256 * 2**20
DEFAULT_PER_TRIAL_BYTES = 64 * 2**20
#: units planned for a fusion key not yet run on a device kind, while it is probed
PROBE_UNITS = 2
#: weight of a new throughput reading in the per-k moving average (1.0 keeps the latest)
THROUGHPUT_SMOOTHING = 0.5

#: longest wait before a failed pack is tried again (settings.retry_backoff doubles up to it)
RETRY_BACKOFF_MAX_S = 60.0
#: a dead worker's row (the API's /api/workers, /metrics' worker_alive) is kept this long
DEAD_WORKER_KEPT_S = 86_400.0
#: attempts ended by faults that are not the trials' a pack may take beyond max_attempts
#: (bounded, so that a trial that kills its worker every time still ends)
MAX_FAULTS = 10

# -- bounded scheduler ticks (service.lifecycle, service.planning, service.scheduler) -------

#: the most trials drawn as one batch (a chunk: cut at fixed offsets from its bracket's
#: start, so that a model draws the same configurations whatever the ticks)
SAMPLE_CHUNK = 2048
#: trials one tick samples over all its studies before it leaves the rest to the next tick
#: (run at once). A chunk is drawn whole: a tick that has drawn nothing yet takes one chunk
#: even above it. Why 1,024: docs/design.md, "Tuning constants"
TICK_SAMPLES = 1024
#: an iteration's first bracket (whose first rung is the study's lowest resource) is drawn
#: from a model in this many waves, each after the first rung of the one before; its other
#: brackets are drawn at once (service.lifecycle.wave_size). Measured on this 2-core AMD
#: EPYC, digits-mlp, 10 seeds (median best val_loss at the study's end; bench b serve,
#: packed over unpacked, side by side with random sampling's): waves in every bracket
#: 0.1011 and 2.43x (random 3.22x); in the first bracket only 0.1001 and 2.39x (random
#: 3.05x; embedded 1.95x against 1.93x): the later brackets' long chains start early
WAVES_PER_BRACKET = 3
#: a model-based bracket waits for earlier brackets' rungs up to the study's rung resource
#: of this index (0: the lowest), or its predecessor's first rung if lower
#: (packtune.iterations.cutoff). Same machine and figures: 1 gave 0.0982 and 2.02x with
#: waves in every bracket, 0.1024 with waves in the first only; 0 gives 0.1001 and 2.39x
WAIT_RUNGS = 0
#: the smallest fair-share quantum (device-seconds per unit of priority) when it follows the
#: median pack time (settings.fair_share_quantum unset): below it, studies a few short packs
#: apart would stop sharing packs
MIN_QUANTUM_S = 1.0
#: the shortest wait of the scheduler's loop for a pack about to become preemptible (its
#: study's device time crossing into the next fair-share band): a floor, so that a tick's
#: own cost (0.3-0.6 s at 10,000 trials, bench d) is not spent over and over
MIN_WAKE_S = 0.05
#: the share of its time an idle scheduler may spend ticking: a tick that found nothing to
#: do waits at least (1 / share - 1) times its own length before the next (a job's end still
#: wakes it at once). Without it, 15 small studies on one ``packtune serve`` on 2 cores (AMD
#: EPYC: idle ticks of 0.23 s, at an interval of 0.2 s) kept its scheduler ticking back to
#: back, a whole core taken from the training it schedules
IDLE_TICK_SHARE = 1 / 3
#: units one plan takes at most (in group order, so arrays stay whole but the last)
MAX_UNITS_PER_PLAN = 2048
#: a tick whose rung decisions moved this many trials of a study plans them at the next tick
PLAN_NEXT_TICK = 1000
#: trial ids per UPDATE on SQLite (its bound-parameter limit is 32,766)
UPDATE_CHUNK = 10_000

# -- the database (service.db, service.api) ---------------------------------------------------

#: seconds a SQLite writer waits for the lock before it gives up
SQLITE_BUSY_TIMEOUT_S = 30.0
#: seconds service.db.retrying keeps trying a transaction while the database is unavailable
RETRY_SECONDS = 60.0
#: API requests that may hold a database session at once; below the pool's 15 connections
#: (SQLAlchemy's 5 + 10 overflow), leaving some for /healthz and /metrics
DB_SLOTS = 10

# -- training (worker) ------------------------------------------------------------------------

#: array sizes the first probe of a fusion key also times (beyond k=1, 2) where half the
#: device's free memory holds them, so the throughput table starts with them
LARGER_PROBE_SIZES = (4, 8, 16)
#: arrays of one pack trained at once on a GPU by default (threads launching kernels)
GPU_ARRAY_THREADS = 4
#: seconds between a training array's writes of its epochs' metrics (each write one
#: transaction, a round trip to PostgreSQL): short epochs are written together, and every
#: epoch before its unit's end is recorded
RECORD_EVERY_S = 0.5
#: on a CPU, a pack's array of at least twice this many trials is cut in halves while the
#: pack has fewer arrays than threads to train them: there an array's step costs about k
#: times one trial's beyond k ~ 12, so two arrays in two threads go faster (digits-mlp on a
#: 2-core CPU, one torch thread each: 1.6x at k = 32, 1.8x at 48; even at 16-24; slower below)
CPU_SPLIT_MIN = 16
#: steps between divergence checks on a GPU (a check synchronises with the device; the first
#: non-finite step is recorded on the device meanwhile, so it is exact either way)
CUDA_CHECK_EVERY = 16
#: seconds between a running pack's looks at its study: a cancel stops it within about this
CANCEL_CHECK_SECONDS = 1.0
#: seconds between a running pack's looks at its own row for a request to give its device
#: up (one primary-key read); it stops at the next training step after it sees one
YIELD_CHECK_SECONDS = 0.1
#: an array asked to give its device up within this many seconds of its start, before it
#: reported an epoch, drops what it trained instead of checkpointing it (its members resume
#: from their checkpoints, exactly): the waiting study starts at once, and a pack that a
#: small study's next rung preempts has usually trained ~0.1 s, about what checkpointing a
#: 70-trial digits-mlp array costs on this 2-core machine's disk
DROP_BELOW_S = 0.25
#: on a CPU, arrays up to this size compute their members' losses one call each
LOOP_LOSS_MAX = 8
#: nesting the fusion guard follows into a module's attribute values before it takes them as
#: different (and trains the members apart)
GUARD_MAX_DEPTH = 8
