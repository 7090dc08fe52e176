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
from collections.abc import Callable

import torch

GLOBAL_RNG = threading.RLock()


def draws_random(run: Callable[[], object], device: torch.device | None = None) -> bool:
    """Whether ``run()`` (one training forward and loss of a model) draws from torch's global
    generators: the CPU one, and ``device``'s where it is a GPU. Dropout modules are one way;
    ``F.dropout``, ``nn.RReLU``, noise added with ``torch.randn_like`` in a loss are others,
    and no list of modules finds them all. Run with :data:`GLOBAL_RNG` held: the generators
    are read before and after, and put back as they were."""
    devices = [device] if device is not None and device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(0)
        before = _states(devices)
        run()
        return not all(torch.equal(a, b) for a, b in zip(before, _states(devices), strict=True))


def _states(devices: list[torch.device]) -> list[torch.Tensor]:
    return [torch.get_rng_state(), *(torch.cuda.get_rng_state(d) for d in devices)]
