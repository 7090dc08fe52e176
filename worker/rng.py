"""The lock on torch's global random state, shared by everything in a worker process that
touches it from more than one thread.

Arrays of one pack train at once, each in a thread (``worker.jobs``). Held while an array
draws from torch's global generator: building its members (each seeded with
``torch.manual_seed``) and, for a stochastic array, each of its steps and evaluations (each
step reseeds it), so arrays trained at once draw exactly what they would draw one after
another; the host's generators (Python's ``random``, NumPy's) likewise, for an array that
draws from them. The steps of an array taken to draw nothing hold it shared, and are
checked (:class:`worker.probe.UnseenDraws`). Held
too while a streamed loader starts its worker processes (``worker.batches``): a process
forked while another thread is inside ``torch.manual_seed`` inherits torch's lazy-CUDA
lock held, and its own first ``manual_seed`` waits for ever (seen: a ``DataLoader`` worker
hung in ``torch.cuda._lazy_call``).
"""

from __future__ import annotations

import functools
import random
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch


class RngLock:
    """An exclusive lock, reentrant like an ``RLock`` (``with GLOBAL_RNG:``), for whatever
    draws from or reseeds the global generators, with a shared side (:meth:`shared`) for the
    steps of members taken to draw nothing: they train at once, and a change of the
    generators across one of them is then a draw of theirs (:class:`worker.probe.UnseenDraws`),
    not of a thread that holds the lock. A waiting exclusive holder goes before new shared
    ones (arrays step back to back). A shared holder that takes the lock exclusively (a
    step's own bookkeeping, in ``fork_rng``) steps aside while it waits: its :class:`Shared`
    then says whether another thread held it meanwhile."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._owner: int | None = None
        self._depth = 0
        self._readers = 0
        self._waiting = 0  # exclusive holders waiting
        self._taken = 0  # exclusive holds so far, of every thread
        self._local = threading.local()  # .shared: this thread's shared depth; .taken: its own

    def __enter__(self) -> RngLock:
        me, local = threading.get_ident(), self._local
        with self._cond:
            if self._owner == me:
                self._depth += 1
                return self
            aside = getattr(local, "shared", 0) > 0
            if aside:
                self._readers -= 1
                self._cond.notify_all()
            self._waiting += 1
            try:
                while self._owner is not None or self._readers:
                    self._cond.wait()
            finally:
                self._waiting -= 1
            self._owner, self._depth = me, 1
            self._taken += 1
            local.taken = getattr(local, "taken", 0) + 1
            local.aside = aside
        return self

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                if getattr(self._local, "aside", False):
                    self._readers += 1  # back to the shared hold it stepped aside from
                    self._local.aside = False
                self._cond.notify_all()

    @contextmanager
    def shared(self) -> Iterator[Shared]:
        """Held with other shared holders, never with an exclusive one of another thread
        (this thread's own exclusive hold includes it)."""
        me, local = threading.get_ident(), self._local
        with self._cond:
            own = self._owner == me
            if not own:
                while self._owner is not None or self._waiting:
                    self._cond.wait()
                self._readers += 1
                local.shared = getattr(local, "shared", 0) + 1
            held = Shared(self, self._taken, getattr(local, "taken", 0))
        try:
            yield held
        finally:
            if not own:
                with self._cond:
                    self._readers -= 1
                    local.shared -= 1
                    if not self._readers:
                        self._cond.notify_all()

    def _others_since(self, taken: int, mine: int) -> bool:
        with self._cond:
            return self._taken - taken > getattr(self._local, "taken", 0) - mine


@dataclass(frozen=True)
class Shared:
    """A shared hold of :data:`GLOBAL_RNG`."""

    lock: RngLock
    taken: int
    mine: int

    def undisturbed(self) -> bool:
        """No other thread held the lock exclusively since the hold began (this one may
        have, having stepped aside)."""
        return not self.lock._others_since(self.taken, self.mine)


GLOBAL_RNG = RngLock()


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
            seed_torch(0)
            before = _states(devices)
            run()
            drew = not same_states(before, _states(devices))
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


@functools.cache
def _accelerator_present() -> bool:
    """Whether this process has a generator beyond the CPU's for ``torch.manual_seed`` to seed
    (CUDA, MPS, XPU, MTIA, or a registered out-of-tree backend); fixed for a process's life."""
    optional = [getattr(torch, name, None) for name in ("xpu", "mtia")]
    return bool(
        torch.cuda.is_available()
        or torch.backends.mps.is_available()
        or any(module is not None and module.is_available() for module in optional)
        or hasattr(torch, torch._C._get_privateuse1_backend_name())
    )


def seed_torch(seed: int) -> None:
    """``torch.manual_seed(seed)``: the same generators left in the same states.

    Where no accelerator can start in this process (a CPU host), the CPU generator alone,
    which is all ``manual_seed`` seeds there: it also queues lazy CUDA, XPU and MTIA seeds, each
    with a copy of the caller's stack (``traceback.format_stack``), ~0.6 ms a call at a
    worker's depth, and a stochastic array reseeds before each member's step."""
    if _accelerator_present():
        torch.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(int(seed))


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


Fingerprint = tuple[Any, ...]


def host_fingerprint() -> Fingerprint:
    """A reading of the host's generators that a draw changes, in about a microsecond
    (:func:`host_state` copies NumPy's whole state: ~0.1 ms, too slow for every step):
    Python's position and first word, and its cached Gaussian; NumPy's position and first
    word, where it is loaded. Read through the generators' C structs where their layout
    checks out against their states (:func:`_struct_readers`), else from the states. Not
    seen: a NumPy Gaussian served from its cache (every other legacy ``randn`` value), which
    moves no position; the next NumPy draw that does is seen."""
    python, numpy = _readers()
    return python(), (numpy() if numpy is not None else None)


def _readers() -> tuple[Callable[[], Any], Callable[[], Any] | None]:
    global _READERS
    numpy = sys.modules.get("numpy")
    if _READERS is None or (_READERS[1] is None and numpy is not None):
        _READERS = _struct_readers(numpy)
    return _READERS


_READERS: tuple[Callable[[], Any], Callable[[], Any] | None] | None = None


def _struct_readers(numpy: Any) -> tuple[Callable[[], Any], Callable[[], Any] | None]:
    import ctypes

    inst = random._inst  # type: ignore[attr-defined]

    def python_slow() -> Any:
        internal = random.getstate()[1]
        return internal[-1], internal[0], getattr(inst, "gauss_next", None)

    python: Callable[[], Any] = python_slow
    try:  # CPython's Random: PyObject_HEAD, int index, uint32_t state[624]
        head = object.__basicsize__
        index = ctypes.c_int.from_address(id(inst) + head)
        first = ctypes.c_uint32.from_address(id(inst) + head + 4)

        def python_fast() -> Any:
            return index.value, first.value, getattr(inst, "gauss_next", None)

        if python_fast() == python_slow():
            python = python_fast
    except Exception:  # noqa: BLE001 - another layout: the slow reading
        pass
    if numpy is None:
        return python, None
    state = numpy.random.mtrand._rand

    def numpy_slow() -> Any:
        _, keys, pos, has_gauss, gauss = state.get_state()
        return pos, int(keys[0]), has_gauss, gauss

    try:  # MT19937's state: uint32_t key[624], int pos (the legacy Gaussian: from get_state)
        address = state._bit_generator.ctypes.state_address
        key = ctypes.c_uint32.from_address(address)
        pos = ctypes.c_int.from_address(address + 624 * 4)
        if (pos.value, key.value) == numpy_slow()[:2]:
            return python, lambda: (pos.value, key.value)
    except Exception:  # noqa: BLE001
        pass
    return python, numpy_slow


def same_states(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Whether two readings of torch's generators (:func:`torch_states`) are the same."""
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def torch_states(device: torch.device) -> list[torch.Tensor]:
    """torch's global generators' states: the CPU one's, and ``device``'s where it is a GPU."""
    return _states([device] if device.type == "cuda" else [])
