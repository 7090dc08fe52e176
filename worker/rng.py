"""The lock on torch's global random state, shared by everything in a worker process that
touches it from more than one thread.

Arrays of one pack train at once, each in a thread (``worker.jobs``). Held while an array
draws from torch's global generator: building its members (each seeded with
``torch.manual_seed``) and, for a stochastic array, all of its training (each step reseeds
it), so arrays trained at once draw exactly what they would draw one after another. Held
too while a streamed loader starts its worker processes (``worker.batches``): a process
forked while another thread is inside ``torch.manual_seed`` inherits torch's lazy-CUDA
lock held, and its own first ``manual_seed`` waits for ever (seen: a ``DataLoader`` worker
hung in ``torch.cuda._lazy_call``).
"""

from __future__ import annotations

import threading

GLOBAL_RNG = threading.RLock()
