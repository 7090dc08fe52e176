"""The lock on torch's global random state, shared by everything in a worker process that
touches it from more than one thread.

Arrays of one pack train at once, each in a thread (``worker.jobs``). Held while an array
draws from torch's global generator: building its members (each seeded with
``torch.manual_seed``) and, for a stochastic array, all of its training (each step reseeds
it), so arrays trained at once draw exactly what they would draw one after another; the
host's generators (Python's ``random``, NumPy's) likewise, for an array that draws from them. Held
too while a streamed loader starts its worker processes (``worker.batches``): a process
forked while another thread is inside ``torch.manual_seed`` inherits torch's lazy-CUDA
lock held, and its own first ``manual_seed`` waits for ever (seen: a ``DataLoader`` worker
hung in ``torch.cuda._lazy_call``).
"""

from __future__ import annotations

import random
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

GLOBAL_RNG = threading.RLock()


@dataclass(frozen=True)
class Draws:
    """What a run drew from: torch's global generators, the host's (Python's ``random``,
    NumPy's global ``numpy.random``)."""

    torch: bool
    host: bool


def draws_random(run: Callable[[], object], device: torch.device | None = None) -> Draws:
    """Whether ``run()`` (one training forward and loss of a model) draws from torch's global
    generators (the CPU one, and ``device``'s where it is a GPU) and from the host's. Dropout
    modules are one way; ``F.dropout``, ``nn.RReLU``, noise added with ``torch.randn_like`` in
    a loss, ``random.random()`` deciding to skip a block are others, and no list of modules
    finds them all. Run with :data:`GLOBAL_RNG` held: the generators are read before and
    after, and put back as they were."""
    devices = [device] if device is not None and device.type == "cuda" else []
    host = host_state()
    try:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(0)
            before = _states(devices)
            run()
            drew = not all(torch.equal(a, b) for a, b in zip(before, _states(devices), strict=True))
        return Draws(torch=drew, host=not same_host(host, host_state()))
    finally:
        set_host_state(host)


HostState = tuple[Any, Any]


def host_state() -> HostState:
    """Python's ``random`` state, and NumPy's global one where NumPy is loaded."""
    numpy = sys.modules.get("numpy")
    return random.getstate(), (numpy.random.get_state() if numpy is not None else None)


def set_host_state(state: HostState) -> None:
    random.setstate(state[0])
    numpy = sys.modules.get("numpy")
    if numpy is not None and state[1] is not None:
        numpy.random.set_state(state[1])


def encode_host(state: HostState) -> dict[str, Any]:
    """``state`` as plain numbers (a checkpoint is loaded with ``weights_only``)."""
    version, internal, gauss = state[0]
    out: dict[str, Any] = {"python": [version, list(internal), gauss]}
    if state[1] is not None:
        kind, keys, pos, has_gauss, cached = state[1]
        out["numpy"] = [kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]
    return out


def decode_host(saved: dict[str, Any]) -> HostState:
    """The state :func:`encode_host` wrote (NumPy's where both then and now have NumPy)."""
    version, internal, gauss = saved["python"]
    numpy = sys.modules.get("numpy")
    np_state = None
    if numpy is not None and "numpy" in saved:
        kind, keys, pos, has_gauss, cached = saved["numpy"]
        np_state = (kind, numpy.array(keys, dtype=numpy.uint32), pos, has_gauss, cached)
    return (version, tuple(internal), gauss), np_state


def seed_host(seed: int) -> None:
    """Seed the host's generators, as ``torch.manual_seed`` seeds torch's."""
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed % 2**32)


def same_host(a: HostState, b: HostState) -> bool:
    """Whether two host states are the same (NumPy's compared by value)."""
    if a[0] != b[0]:
        return False
    if a[1] is None or b[1] is None:
        return a[1] is b[1]
    numpy = sys.modules["numpy"]
    return bool(a[1][0] == b[1][0] and numpy.array_equal(a[1][1], b[1][1])
                and tuple(a[1][2:]) == tuple(b[1][2:]))  # fmt: skip


def _states(devices: list[torch.device]) -> list[torch.Tensor]:
    return [torch.get_rng_state(), *(torch.cuda.get_rng_state(d) for d in devices)]
