"""Memory probe: how many bytes an array of k trials needs, and how fast it trains.

The planner's memory model is ``bytes(k) = base + k * per_trial``. The probe
trains arrays of k = 1 and 2 (``ks``) for a few steps and fits the line
through their peaks: ``per_trial = peak(2) - peak(1)``,
``base = 2 * peak(1) - peak(2)`` (clamped to ``per_trial >= 1``,
``base >= 0``). It also times those steps, giving trial-steps per second per
k for the planner's throughput table. Storing the results is the job's
business; nothing here touches a database.

- On CUDA the peak is measured: ``torch.cuda.reset_peak_memory_stats`` then
  ``max_memory_allocated`` around a warm-up step and ``steps`` timed steps
  (throughput from the fastest of them).
  The dataset already on the device counts toward ``base``; a streaming
  workload's data set does not (it stays on the host), only the batches in flight.
- On a CPU there is no allocator counter worth trusting, so the peak is an
  estimate: the dataset (in-memory workloads), the stacked parameters, their
  gradients, buffers and optimizer state, plus what one training step keeps
  alive for backward (the tensors autograd saves, measured with
  ``saved_tensors_hooks`` and counted once per storage) plus the batch (twice for a
  streaming workload: the one in use and the next being prefetched). It leaves out
  allocator slack and short-lived temporaries, so it is a lower bound of the true peak.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from packtune.spec import TrainingSettings
from packtune.workloads.base import Split, Workload, data_splits
from worker.batches import tensors
from worker.fused import FusedArray, StackMode
from worker.rng import GLOBAL_RNG


@dataclass(frozen=True)
class ProbeResult:
    """The fitted memory line and the raw measurements behind it."""

    base_bytes: int
    per_trial_bytes: int
    peak_by_k: dict[int, int]
    throughput_by_k: dict[int, float]  # trial-steps per second
    measured: bool  # True: CUDA allocator peaks; False: CPU estimates

    def bytes_for(self, k: int) -> int:
        return self.base_bytes + k * self.per_trial_bytes


def _storage_bytes(tensors: Sequence[Tensor], seen: set[int]) -> int:
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _cpu_peak(array: FusedArray, batch: Any) -> int:
    """Estimated peak bytes of one training step of ``array`` (see module docstring)."""
    seen: set[int] = set()
    total = 0
    if array.train_split is not None and array.val_split is not None:
        data = [array.train_split.x, array.train_split.y, array.val_split.x, array.val_split.y]
        total += _storage_bytes(data, seen)
    by_group = array.group_batches(batch)
    in_flight = 2 if array.streaming else 1  # streamed: the next batch is on its way
    for _, own in by_group:
        total += in_flight * _storage_bytes(tensors(own), seen)
    for group in array.groups:
        params = list(group.params.values())
        state = [t for slots in group.optimizer.state.values() for t in slots.values()]
        total += _storage_bytes(params + list(group.buffers.values()) + state, seen)
        total += sum(p.nbytes for p in params if p.requires_grad)  # the gradients
    saved: list[Tensor] = []

    def pack(t: Tensor) -> Tensor:
        saved.append(t)
        return t

    for group, own in by_group:
        # with its members' values kept outside the model and torch settings, as its steps
        with (
            array.measured_with(group) as workload,
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        ):
            losses = group.batch_losses(own, workload)
        total += _storage_bytes(saved + [losses], seen)
        saved.clear()
    return total


def _step_seconds(array: FusedArray, workload: Workload, steps: int) -> float:
    """Fastest of ``steps`` timed steps, after one warm-up step.

    The minimum, not the mean: on a shared or oversubscribed CPU single steps
    stall for tens of milliseconds, and the planner compares array sizes.
    """
    batches = list(array.epoch_inputs(0, 0, min(steps + 1, array.steps_per_epoch)))
    sync = torch.cuda.synchronize if array.device.type == "cuda" else (lambda device: None)
    array.train_step(batches[0])
    sync(array.device)
    best = float("inf")
    for s in range(steps):
        start = time.perf_counter()
        array.train_step(batches[(s + 1) % len(batches)])
        sync(array.device)
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


def probe(
    workload: Workload,
    config: Mapping[str, Any],
    device: str | torch.device = "cpu",
    ks: Sequence[int] = (1, 2),
    steps: int = 2,
    mode: StackMode = "auto",
    data: tuple[Split, Split] | None = None,
    training: TrainingSettings | None = None,
    segment: int | None = None,
) -> ProbeResult:
    """Measure peak memory and throughput of arrays of each size in ``ks``.

    ``config`` is one trial's config (``seed`` and ``data_seed`` optional);
    member j of the probe array gets ``seed + j``. ``training`` and ``segment``: how the
    arrays train (decoupled; one segment of a segment unit), as :class:`FusedArray`.
    """
    if len(set(ks)) < 2:
        raise ValueError("the probe needs at least two array sizes")
    device = torch.device(device)
    cuda = device.type == "cuda"
    cfg = workload.resolve(config)
    seed = int(cfg.get("seed", 0))
    if data is None and not workload.streams:
        data = data_splits(workload, cfg, device)
    peaks: dict[int, int] = {}
    throughput: dict[int, float] = {}
    for k in sorted(set(ks)):
        members = [(j, {**cfg, "seed": seed + j}) for j in range(k)]
        gc.collect()
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        # its builds seed torch's generator and may set values kept outside the model,
        # which arrays trained at once in other threads read: as an array's build is
        with GLOBAL_RNG:
            array = FusedArray(workload, members, device=device, mode=mode, data=data,
                               training=training, segment=segment)  # fmt: skip
        throughput[k] = k / _step_seconds(array, workload, steps)
        if cuda:
            peaks[k] = int(torch.cuda.max_memory_allocated(device))
        else:
            with GLOBAL_RNG:  # its forwards may draw, as a stochastic array's steps do
                peaks[k] = _cpu_peak(array, next(array.epoch_inputs(0, 0, 1)))
        del array
    (k1, p1), (k2, p2) = sorted(peaks.items())[:2]
    per_trial = max(1, round((p2 - p1) / (k2 - k1)))
    base = max(0, p1 - k1 * per_trial)
    return ProbeResult(base, per_trial, peaks, throughput, measured=cuda)
