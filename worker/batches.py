"""Streamed batches: from a workload's loader to the device, one epoch at a time.

A streaming workload (:meth:`packtune.workloads.base.Workload.train_batches`) yields host
batches, e.g. from a ``DataLoader``: ``(inputs, targets)`` or any nesting of tuples,
lists and dicts of tensors. :func:`epoch_batches` skips the batches a resumed trial has
trained on, checks that the epoch is long enough, and moves each batch to the device.

On a GPU the copies are pinned and overlapped with compute (:class:`Prefetcher`): while
the device trains on batch ``i``, batch ``i + 1`` is copied on a side stream, and the
compute stream waits for that copy only when it needs the batch. On a CPU a batch is
used where it is.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

from worker.rng import GLOBAL_RNG, host_state, same_host, seed_host, set_host_state


def tree_map(fn: Callable[[Tensor], Any], batch: Any) -> Any:
    """``fn`` applied to every tensor of ``batch`` (tuples, lists and dicts nest)."""
    if isinstance(batch, Tensor):
        return fn(batch)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(tree_map(fn, b) for b in batch))
    if isinstance(batch, list | tuple):
        return type(batch)(tree_map(fn, b) for b in batch)
    if isinstance(batch, dict):
        return {key: tree_map(fn, value) for key, value in batch.items()}
    return batch


def tensors(batch: Any) -> list[Tensor]:
    """Every tensor of ``batch``, in order."""
    found: list[Tensor] = []
    tree_map(found.append, batch)
    return found


def batch_size(batch: Any) -> int:
    """Examples in ``batch``: the first dimension of its first tensor."""
    leaves = tensors(batch)
    if not leaves or leaves[0].dim() == 0:
        raise ValueError("a batch must hold at least one tensor with a batch dimension")
    return int(leaves[0].shape[0])


def stack_batches(batches: list[Any]) -> Any:
    """k members' batches of one structure as one batch of ``[k, ...]`` tensors."""
    first = batches[0]
    if isinstance(first, Tensor):
        return torch.stack(batches)
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(stack_batches(list(parts)) for parts in zip(*batches, strict=True)))
    if isinstance(first, list | tuple):
        return type(first)(stack_batches(list(parts)) for parts in zip(*batches, strict=True))
    if isinstance(first, dict):
        return {key: stack_batches([b[key] for b in batches]) for key in first}
    return first


def to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    return tree_map(lambda t: t.to(device, non_blocking=non_blocking), batch)


class Prefetcher:
    """Batches of ``source`` on a CUDA ``device``, each copied on a side stream while the
    previous one is in use: pinned host memory (a ``DataLoader(pin_memory=True)`` batch
    is already pinned), ``non_blocking`` copies, the compute stream waiting on an event."""

    def __init__(self, source: Iterator[Any], device: torch.device) -> None:
        self.source, self.device = source, device
        self.stream = torch.cuda.Stream(device)
        self.next: tuple[Any, torch.cuda.Event] | None = None
        self._load()

    def _load(self) -> None:
        try:
            host = next(self.source)
        except StopIteration:
            self.next = None
            return
        with torch.cuda.stream(self.stream):
            pinned = tree_map(lambda t: t if t.is_pinned() else t.pin_memory(), host)
            moved = to_device(pinned, self.device, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        self.next = (moved, ready)

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> Any:
        if self.next is None:
            raise StopIteration
        batch, ready = self.next
        current = torch.cuda.current_stream(self.device)
        current.wait_event(ready)
        # the tensors were made on the side stream: keep their memory until compute is done
        tree_map(lambda t: t.record_stream(current), batch)
        self._load()
        return batch


def started(source: Iterable[Any], seed: int | None = None) -> Iterator[Any]:
    """``iter(source)`` under the RNG lock: a loader's iterator may fork its worker
    processes here, which must not happen while another thread is inside
    ``torch.manual_seed`` (see :mod:`worker.rng`). With ``seed``: the source draws from
    random streams of its own (:class:`OwnStreams`)."""
    if seed is not None:
        return OwnStreams(source, seed)
    with GLOBAL_RNG:
        return iter(source)


class OwnStreams:
    """The batches of ``source``, every draw it makes in this process from torch's CPU
    generator and the host's (Python's ``random``, NumPy's) coming from streams of its own,
    seeded from ``seed`` (an epoch's: :func:`packtune.workloads.base.epoch_seed`).

    A ``DataLoader`` without worker processes reads its dataset here: an augmentation with
    torch's global generator (as torchvision's random transforms draw), or a sampler or base
    seed drawn without a ``generator``, then drew from wherever the trainer had left the
    global generators, so its batches depended on the pack and on where a trial resumed.
    Starting the iterator (its sampler's and workers' seeds) draws from them too; a loader
    with worker processes reads elsewhere, so only its start is seeded. The host's streams
    (NumPy's state costs ~0.1 ms to read or set) are swapped for a batch only where the
    first batch was seen to draw from them."""

    def __init__(self, source: Iterable[Any], seed: int) -> None:
        in_process = getattr(source, "num_workers", 0) == 0
        with GLOBAL_RNG:
            outer, host = torch.get_rng_state(), host_state()
            torch.default_generator.manual_seed(seed)  # the CPU's only: a GPU's are not read
            seed_host(seed)
            try:
                self.iterator = iter(source)
            finally:
                self.torch_state = torch.get_rng_state() if in_process else None
                self.host_state = host_state()
                torch.set_rng_state(outer)
                set_host_state(host)
        #: whether its batches draw from the host's generators (None: not seen yet)
        self.draws_host: bool | None = None

    def __iter__(self) -> OwnStreams:
        return self

    def __next__(self) -> Any:
        if self.torch_state is None:
            return next(self.iterator)
        swap_host = self.draws_host is not False
        with GLOBAL_RNG:
            outer = torch.get_rng_state()
            outer_host = host_state() if swap_host else None
            torch.set_rng_state(self.torch_state)
            if swap_host:
                set_host_state(self.host_state)
            try:
                return next(self.iterator)
            finally:
                self.torch_state = torch.get_rng_state()
                torch.set_rng_state(outer)
                if outer_host is not None:
                    after = host_state()
                    if self.draws_host is None:
                        self.draws_host = not same_host(self.host_state, after)
                    self.host_state = after
                    set_host_state(outer_host)


def on_device(source: Iterable[Any], device: torch.device) -> Iterator[Any]:
    """``source``'s batches on ``device``: prefetched on a GPU, as they are on a CPU."""
    if device.type == "cuda":
        return Prefetcher(iter(source), device)
    return (to_device(batch, device) for batch in source)


def epoch_batches(
    source: Iterable[Any],
    skip: int,
    count: int,
    device: torch.device,
    what: str,
    seed: int | None = None,
) -> Iterator[Any]:
    """Batches ``skip`` to ``skip + count`` of one epoch of ``source``, on ``device``; its
    draws from the epoch's own random streams where ``seed`` is given (:class:`OwnStreams`).

    Raises ``ValueError`` naming ``what`` when the epoch ends before them: a loader that
    yields fewer batches than the workload's ``steps_per_epoch``.
    """
    it = started(source, seed)
    for _ in itertools.islice(it, skip):  # a resumed trial: the batches it trained on
        pass
    wanted = itertools.islice(it, count)
    seen = 0
    for batch in on_device(wanted, device):
        seen += 1
        yield batch
    if seen < count:
        raise ValueError(
            f"{what} yielded {skip + seen} batches, fewer than the {skip + count} "
            "its steps_per_epoch() needs (drop_last=True, and steps_per_epoch matching len())"
        )
