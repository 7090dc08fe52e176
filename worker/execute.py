"""Train one fused array of a pack and record it: measurements, checkpoints, profiles.

Plain values in (:class:`ArrayJob`), rows out. Errors raised by the workload
or the training code become :class:`TrialError` (the job then isolates the
trial at fault); database trouble and CUDA out-of-memory pass through
unchanged, because they are not a trial's fault. Every write is tried again
for up to a minute while the database is unavailable (:func:`retrying`), so
a database restart in the middle of a pack loses nothing: training waits.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import math
import threading
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from packtune.errors import StoreUnavailable
from packtune.packing import MemoryModel
from packtune.settings import get_settings
from packtune.space import fusion_key, trial_seed
from packtune.spec import TrainingSettings
from packtune.spilling import Unspillable
from packtune.tuning import DROP_BELOW_S, HEADROOM, LARGER_PROBE_SIZES, RECORD_EVERY_S
from packtune.workloads import get_workload
from packtune.workloads.base import ConfigReads, Workload, data_splits, varying_reads
from service import store
from service.db import retrying
from service.models import TrialStatus
from worker import outside_state as outside
from worker.checkpoints import Staged, load_checkpoint, stage_checkpoint
from worker.fused import BuildError, Dropped, FusedArray, Report, train
from worker.memory import probe
from worker.probe import UnseenDraws
from worker.rng import GLOBAL_RNG

log = logging.getLogger(__name__)

#: raised by an array's training, the pack's trouble, not its trials': the pack tries again
#: (a draw its probe missed: :class:`~worker.probe.UnseenDraws`, now known to this process)
NOT_A_TRIAL_FAULT = (StoreUnavailable, SQLAlchemyError, torch.cuda.OutOfMemoryError, UnseenDraws)


#: how one array of a pack ran (``packs.arrays``): trials, stacks ({trials, mode}), notes,
#: failed trials, gave_up (it stopped short: the pack gave its device up)
ArrayRun = dict[str, Any]
#: an :data:`ArrayRun`'s entry, while its pack runs, with how fast a shared array trained:
#: ``{"trial_steps", "start", "end", "k"}`` (``perf_counter`` seconds); never recorded
SPEED = "_speed"


class PackCancelled(Exception):
    """The pack's study was cancelled while it trained: it stopped at a step boundary."""


class ObjectiveNotReported(Exception):
    """Measurements of trials lack their study's objective metric: the workload does not
    declare its metrics (``reports``), so the study could name one it never reports.
    ``trials``: the trials whose measurement lacks it (an array may hold trials of several
    studies, of other objectives)."""

    def __init__(self, message: str, trials: frozenset[int]) -> None:
        self.trials = trials
        super().__init__(message)


class TrialError(Exception):
    """The workload or the training code raised for this array."""

    def __init__(self, exc: BaseException) -> None:
        # a BuildError's message already starts with the cause's type
        self.text = str(exc) if isinstance(exc, BuildError) else f"{type(exc).__name__}: {exc}"
        #: the trials the cause is known to be theirs (a metric their workload never
        #: reports): where that is every member of the array, running them one by one to
        #: find a culprit would only raise it again for each
        self.culprits = exc.trials if isinstance(exc, ObjectiveNotReported) else frozenset()
        super().__init__(self.text)


def check_objective_reported(
    workload: str, measured: Mapping[int, tuple[str, Mapping[str, Any]]]
) -> None:
    """Raise :class:`ObjectiveNotReported` when a measurement of ``measured`` (trial id ->
    its study's objective metric, its metrics) lacks that metric: without it the trial would
    rank last, silently, and its study end without a best trial."""
    lacking = {tid: (name, metrics) for tid, (name, metrics) in measured.items()
               if name not in metrics}  # fmt: skip
    if lacking:
        name, metrics = next(iter(lacking.values()))
        raise ObjectiveNotReported(
            f"workload {workload!r} did not report the study's objective metric {name!r} "
            f"(it reported {sorted(metrics)}): name one of those in objective.metric, or "
            "make the workload report it",
            frozenset(lacking),
        )


@dataclass(frozen=True)
class MemberJob:
    trial_id: int
    sample_index: int
    config: dict[str, Any]
    resource_done: float
    checkpoint_path: str | None
    rung_resource: float  # where the trial's current rung is decided (>= the unit's end)
    study_id: int  # an array may hold trials of several studies (one data seed)
    study_seed: int
    metric: str  # its study's objective metric
    #: its study's ``max_resource``: the horizon of its learning-rate schedule, given to the
    #: workload as ``config["max_epochs"]``; members of one array may have different ones
    horizon: float


@dataclass(frozen=True)
class ArrayJob:
    """Trials that train as one model: one workload, fusion key and resource span, and one
    ``data_seed`` (what their studies must agree on to share batches); each member keeps
    its own study, seed, objective and horizon (its schedule's: schedules are per member)."""

    pack_id: int
    data_seed: int  # the studies' seed: the order of the batches every member sees
    workload: str
    fusion_key: str
    from_resource: float
    to_resource: float
    members: list[MemberJob]
    #: how the members train (end to end, or decoupled segments): their studies' setting
    training: TrainingSettings = field(default_factory=TrainingSettings)
    #: the one segment of the members' decoupled models to train (a segment unit:
    #: :mod:`worker.segment_units`); -1: the whole model
    segment: int = -1

    def alone(self, member: MemberJob) -> ArrayJob:
        return dataclasses.replace(self, members=[member])

    def config(self, m: MemberJob) -> dict[str, Any]:
        return {
            **m.config,
            "seed": trial_seed(m.study_seed, m.sample_index),
            "data_seed": self.data_seed,
            "max_epochs": m.horizon,
        }


def _id(key: Hashable) -> int:
    """Array members are keyed by trial id."""
    assert isinstance(key, int)
    return key


def span_steps(job: ArrayJob, steps_per_epoch: int) -> tuple[int, int]:
    return round(job.from_resource * steps_per_epoch), round(job.to_resource * steps_per_epoch)


def member_checkpoint(
    m: MemberJob, from_step: int, to_step: int, trained_elsewhere: bool = False
) -> tuple[dict[str, Any] | None, bool]:
    """``m``'s checkpoint (None: a fresh trial) and whether its unit is trained already (its
    checkpoint at ``to_step``, or ``trained_elsewhere``: by a run that died before it
    recorded it); raises when the checkpoint is missing or at neither end of the unit."""
    state = load_checkpoint(m.checkpoint_path) if m.checkpoint_path else None
    steps = int(state["steps_done"]) if state else 0
    if state is None and m.resource_done > 0:
        raise RuntimeError(f"trial {m.trial_id}: checkpoint {m.checkpoint_path} is missing")
    if (steps == to_step or trained_elsewhere) and to_step > from_step:
        return state, True
    if steps != from_step:
        raise RuntimeError(f"trial {m.trial_id}: checkpoint at step {steps}, expected {from_step}")
    return state, False


def mark_done(
    job: ArrayJob,
    done: Mapping[int, str | Staged],
    resource: float | None = None,
) -> set[int]:
    """Trials whose unit is finished (or, with ``resource``, that stopped there on the way,
    their pack giving its device up): resource, checkpoint, and ``paused`` for the scheduler
    at their rung, or ``pending`` when they are not at it yet. Only trials still running
    and still at the unit's start move: one that a late writer finds on its next unit
    already (a segment unit finishing a trial another had finished) is left alone.

    A :class:`~worker.checkpoints.Staged` checkpoint is put in place inside the transaction
    that moves its trial, before the commit, and only if it moved; otherwise it is thrown
    away. A job whose pack was trained again elsewhere (its worker stalled past the
    heartbeat timeout, then went on) so never overwrites the newer checkpoint; a commit
    that fails after the move leaves the checkpoint ahead of its row, which the next
    attempt takes as trained (:func:`member_checkpoint`). Returns the trials moved."""
    targets = {m.trial_id: m.rung_resource for m in job.members}
    reached = job.to_resource if resource is None else resource
    moved_ids: set[int] = set()

    def write(s: Session) -> None:
        moved_ids.clear()  # a retried transaction moves them again
        for trial_id, saved in done.items():
            at_rung = reached >= targets[trial_id] or math.isclose(
                reached, targets[trial_id], rel_tol=1e-9
            )
            path = str(saved.path) if isinstance(saved, Staged) else saved
            moved = store.move_trials(  # only from running: a trial cancelled meanwhile stays so
                s, [trial_id], TrialStatus.paused if at_rung else TrialStatus.pending,
                only_from=(TrialStatus.running,), only_at=job.from_resource,
                resource_done=reached, checkpoint_path=path,
            )  # fmt: skip
            if moved:
                moved_ids.add(trial_id)
                if isinstance(saved, Staged):
                    saved.commit()

    try:
        retrying(write)
    finally:
        for saved in done.values():
            if isinstance(saved, Staged):
                saved.discard()  # those not put in place (a committed one has no file left)
    return moved_ids


@functools.cache
def _settle_heap() -> None:
    """Collect once, then freeze what survives (imports, datasets) out of the collector's way.

    The probe collects garbage before each array size; frozen objects are skipped by
    later collections, which then take milliseconds instead of most of a CPU probe. (The
    embedded runner freezes its heap at its warm-up, so this collection is quick there.)
    """
    gc.collect()
    gc.freeze()


def _free_bytes(device: torch.device) -> int:
    """A GPU's free memory; a CPU's ``PACKTUNE_CPU_MEMORY_BUDGET``."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return get_settings().cpu_memory_budget


def device_capacity(device: torch.device) -> int:
    """Bytes a pack may use on ``device``: its free bytes with the planner's headroom."""
    return int(_free_bytes(device) * HEADROOM)


def _larger_probe_sizes(bytes_for: Callable[[int], int], device: torch.device) -> tuple[int, ...]:
    free = _free_bytes(device)
    return tuple(k for k in LARGER_PROBE_SIZES if bytes_for(k) <= free // 2)


class SpillAlone(Exception):
    """A spilled array alternating with others found a layer too large for its share of
    the device, before it trained a step: it is to run again with the device to itself."""


def spill_budget(
    job: ArrayJob, kind: str, device: torch.device, k: int, share: int = 1
) -> int | None:
    """The device bytes ``job``'s array of ``k`` may use spilled, when its estimated memory
    exceeds the device's capacity (the planner planned it alone for that reason, or with
    other such arrays to alternate with: then ``share`` of them split the device); None
    when it fits, or with ``PACKTUNE_SPILL=false``."""
    if not get_settings().spill:
        return None
    profile = retrying(lambda s: store.get_profile(s, job.workload, job.fusion_key, kind))
    if profile is None or profile.base_bytes is None or profile.per_trial_bytes is None:
        return None
    capacity = device_capacity(device)
    need = MemoryModel(int(profile.base_bytes), int(profile.per_trial_bytes)).bytes(k)
    return capacity // share if need > capacity else None


def is_profiled(job: ArrayJob, kind: str) -> bool:
    """Whether ``job``'s fusion key has its memory measured on this device kind."""

    def probed(s: Session) -> bool:
        profile = store.get_profile(s, job.workload, job.fusion_key, kind)
        return profile is not None and profile.base_bytes is not None

    return bool(retrying(probed))


def ensure_profile(
    job: ArrayJob, config: dict[str, Any], device: torch.device, kind: str, data: Any
) -> None:
    """Probe memory (k=1, k=2) and throughput (k=1, 2 and :data:`LARGER_PROBE_SIZES`) the
    first time this fusion key runs on this device kind."""
    workload = get_workload(job.workload)
    if is_profiled(job, kind):
        return
    _settle_heap()
    # a segment unit's key is its segment's: the probe measures that segment alone (other
    # arrays, decoupled ones too, are probed end to end: an upper bound of their memory)
    segment = job.segment if job.segment >= 0 else None
    training = job.training if segment is not None else None
    result = probe(workload, config, device, ks=(1, 2), steps=2, data=data,
                   training=training, segment=segment)  # fmt: skip
    throughput = dict(result.throughput_by_k)
    larger = _larger_probe_sizes(result.bytes_for, device)
    if len(larger) >= 2:
        more = probe(workload, config, device, ks=larger, steps=2, data=data,
                     training=training, segment=segment)  # fmt: skip
        throughput.update(more.throughput_by_k)

    def write(s: Session) -> None:
        store.set_memory_model(
            s, job.workload, job.fusion_key, kind, result.base_bytes, result.per_trial_bytes
        )
        profile = store.get_profile(s, job.workload, job.fusion_key, kind)
        measured = set(profile.throughput) if profile is not None else set()
        for k, value in throughput.items():
            if str(k) not in measured:
                store.record_throughput(s, job.workload, job.fusion_key, kind, k, value)

    retrying(write)


def _structural_parts(workload: Workload, job: ArrayJob) -> list[list[MemberJob]]:
    """``job``'s members grouped by their structural values under the workload's definition
    now: one group, unless the trials were sampled when it declared fewer parameters
    structural (their stored fusion key then joins trials that must not share an array)."""
    structural = workload.structural_params()
    parts: dict[str, list[MemberJob]] = {}
    for m in job.members:
        try:
            key = fusion_key(workload.name, workload.resolve(m.config), structural)
        except Exception as exc:  # e.g. a parameter the workload no longer takes
            raise TrialError(exc) from exc
        parts.setdefault(key, []).append(m)
    return list(parts.values())


def _data_parts(
    workload: Workload,
    todo: list[MemberJob],
    configs: Mapping[int, Mapping[str, Any]],
    reads: set[str],
) -> tuple[list[str], list[list[MemberJob]]]:
    """The parameters the data path read (``reads``) whose values differ between ``todo``'s
    members (structural ones and ``data_seed`` are equal in an array already), and the
    members grouped by their values: one group where none differ."""
    resolved = {m.trial_id: workload.resolve(configs[m.trial_id]) for m in todo}
    varying = varying_reads(workload, list(resolved.values()), reads)
    groups: dict[tuple[str, ...], list[MemberJob]] = {}
    for m in todo:
        values = tuple(repr(resolved[m.trial_id].get(key)) for key in varying)
        groups.setdefault(values, []).append(m)
    return varying, list(groups.values())


def workload_steps(workload: Workload, config: Mapping[str, Any]) -> int:
    """``workload``'s steps per epoch for ``config``: what its own code raises there (a
    train_size of the wrong kind) is the trials' fault, not the pack's (retried)."""
    try:
        return workload.steps_per_epoch(config)
    except NOT_A_TRIAL_FAULT:
        raise
    except Exception as exc:
        raise TrialError(exc) from exc


def _read_data(
    workload: Workload, first: Mapping[str, Any], device: torch.device
) -> tuple[Any, set[str]]:
    """The workload's in-memory data for ``first`` (None: it streams), and the keys of the
    config its data path reads (``data``, ``steps_per_epoch``, ``batch_indices``).

    Read as in a fresh process, before any build: while no other array of the process
    steps (each of a pack's arrays reads its data in its own thread; a data() that seeds
    torch's generator would move another's draws, and one reading a value kept outside the
    model would read the member's that step put back), and with the values builds changed
    put back as they were before the process's first build."""
    try:
        seen = ConfigReads(first)
        with GLOBAL_RNG:
            outside.fresh(outside.namespaces(workload))
            data = None if workload.streams else data_splits(workload, seen, device)
            if not workload.streams:
                workload.steps_per_epoch(seen)
                next(iter(workload.batch_indices(seen, 0)), None)
    except NOT_A_TRIAL_FAULT:
        raise
    except Exception as exc:
        raise TrialError(exc) from exc
    return data, seen.reads


def _apart_by_data(
    job: ArrayJob,
    workload: Workload,
    todo: list[MemberJob],
    reads: set[str],
    apart: Callable[[list[list[MemberJob]]], list[ArrayRun]],
) -> list[ArrayRun] | None:
    """``todo`` trained as arrays apart (``apart``), with a note, where its members differ
    in a parameter the data path read (``reads``); None where they share batches."""
    configs = {m.trial_id: job.config(m) for m in todo}
    varying, parts = _data_parts(workload, todo, configs, reads)
    if len(parts) < 2:
        return None
    note = (
        f"{workload.name}'s data path reads {', '.join(varying)}, which differ between "
        f"trials {', '.join(str(m.trial_id) for m in todo)}: they cannot share batches, "
        f"so they trained as {len(parts)} arrays (declare {', '.join(varying)} structural, "
        "not fusible)"
    )
    log.warning("pack %s: %s", job.pack_id, note)
    runs = apart(parts)
    for run in runs:
        run["notes"] = [note, *run.get("notes", [])]
    return runs


def _run_apart(
    job: ArrayJob,
    parts: list[list[MemberJob]],
    device: torch.device,
    kind: str,
    checkpoint_dir: Path,
    stop: threading.Event | None,
    give_up: threading.Event | None,
    spill_share: int,
) -> list[ArrayRun]:
    """``job``'s members that must not share an array, ``parts`` of them one after another,
    each an array of its own (their speeds are not the fusion key's: ``shared``)."""
    return [
        run
        for part in parts
        for run in run_array(dataclasses.replace(job, members=part), device, kind,
                             checkpoint_dir, True, stop, give_up, spill_share)
    ]  # fmt: skip


def run_array(
    job: ArrayJob,
    device: torch.device,
    kind: str,
    checkpoint_dir: Path,
    shared: bool = False,
    stop: threading.Event | None = None,
    give_up: threading.Event | None = None,
    spill_share: int = 1,
) -> list[ArrayRun]:
    """Train ``job``'s members from its from- to its to-resource, recording as it goes;
    returns how the array ran (its stacks and notes: the pack keeps them).

    ``spill_share``: this many spilled arrays of the pack alternate on the device, each in
    its share of it, one shard at a time (:class:`SpillAlone` where a layer does not fit).
    ``shared``: other arrays train at the same time (threads of one job); its speed is
    then not its own, so it records no throughput reading. ``stop``: the study was
    cancelled (:class:`PackCancelled` at the next step). ``give_up``: the device is wanted
    elsewhere: the array stops at its next training step and its members are checkpointed
    there and ``pending`` again; an array not begun yet, or asked within
    :data:`~packtune.tuning.DROP_BELOW_S` of its start before it reported an epoch, is left
    as it was (its training dropped: the job releases its members, which resume from their
    checkpoints).
    """
    workload = get_workload(job.workload)

    def apart(parts: list[list[MemberJob]]) -> list[ArrayRun]:
        return _run_apart(job, parts, device, kind, checkpoint_dir, stop, give_up, spill_share)

    parts = _structural_parts(workload, job)
    if len(parts) > 1:
        log.warning(
            "pack %s: trials %s share the fusion key %s but not every structural parameter "
            "of %s (sampled under an older definition of the workload?); trained as %d arrays",
            job.pack_id, [m.trial_id for m in job.members], job.fusion_key, job.workload,
            len(parts),
        )  # fmt: skip
        return apart(parts)
    configs = {m.trial_id: job.config(m) for m in job.members}
    first = workload.resolve(next(iter(configs.values())))
    if job.segment >= 0:
        from worker.segment_units import run_segment_array  # it builds on this module

        # its members share the first one's batches as an array's do: apart where they differ
        # in a parameter the data path reads
        data, reads = _read_data(workload, first, device)
        runs = _apart_by_data(job, workload, list(job.members), reads, apart)
        if runs is not None:
            return runs
        return run_segment_array(job, device, kind, checkpoint_dir, stop, data)
    spe = workload_steps(workload, first)
    from_step, to_step = span_steps(job, spe)
    todo, states, done = [], [], {}
    for m in job.members:
        state, trained = member_checkpoint(m, from_step, to_step)
        if trained:
            done[m.trial_id] = str(m.checkpoint_path)  # trained by a run that died before recording
        else:
            todo.append(m)
            states.append(state)
    if done:
        mark_done(job, done)
    if not todo or (give_up is not None and give_up.is_set()):
        return []
    data, reads = _read_data(workload, first, device)
    runs = _apart_by_data(job, workload, todo, reads, apart)
    if runs is not None:
        return runs
    try:
        ensure_profile(job, first, device, kind, data)
        budget = spill_budget(job, kind, device, len(todo), spill_share)
        settings = get_settings()
        with GLOBAL_RNG:
            array = FusedArray(
                workload, [(m.trial_id, configs[m.trial_id]) for m in todo],
                device=device, states=states, data=data, spill_budget=budget,
                spill_prefetch=spill_share == 1, training=job.training,
                compile_step=settings.compile_step == "on", compile_mode=settings.compile_mode,
            )  # fmt: skip
    except NOT_A_TRIAL_FAULT:
        raise
    except Exception as exc:
        raise TrialError(exc) from exc

    metric = {m.trial_id: m.metric for m in job.members}
    study_of = {m.trial_id: m.study_id for m in job.members}

    def write(s: Session, report: Report) -> None:
        resource = job.to_resource if report.step >= to_step else report.resource
        by_metric: dict[str, list[tuple[int, float, dict[str, float]]]] = {}
        for key, metrics in report.metrics.items():
            row = (_id(key), resource, metrics)
            by_metric.setdefault(metric[_id(key)], []).append(row)
        for name, rows in by_metric.items():
            store.record_measurements(s, rows, metric=name)
        for trial_id in report.diverged:
            step = array.diverged[trial_id]
            # A point where it diverged, with no objective: it then ranks last, not by an
            # older finite value (and its curve shows where it ended).
            nan = {"train_loss": math.nan}
            store.record_measurement(
                s, _id(trial_id), step / spe, nan, metric=metric[_id(trial_id)]
            )
            store.move_trials(
                s, [_id(trial_id)], TrialStatus.diverged,
                error=f"loss became non-finite at step {step}",
            )  # fmt: skip

    # Epochs' reports are written together, at most RECORD_EVERY_S apart (one transaction
    # for many short epochs), and all of them before the unit's end is: its rung decision
    # reads them. The first epoch and a divergence are written at once (the dashboard sees
    # a run start; a unit killed after its first epoch is seen to have been cut short).
    unwritten: list[Report] = []
    written_at = -math.inf

    def flush() -> None:
        nonlocal written_at
        reports = list(unwritten)
        unwritten.clear()  # taken, even if the write fails: a failed write fails the pack

        def write_all(s: Session) -> None:
            for report in reports:
                write(s, report)

        if reports:
            retrying(write_all)
        written_at = time.perf_counter()

    def record(report: Report) -> None:
        measured = {_id(key): (metric[_id(key)], m) for key, m in report.metrics.items()}
        check_objective_reported(job.workload, measured)
        unwritten.append(report)
        if report.diverged or time.perf_counter() - written_at >= RECORD_EVERY_S:
            flush()

    k = len(todo)
    started = time.perf_counter()
    try:
        try:
            # each step holds the global generators as it needs (FusedArray.train_step)
            train(array, to_step, on_report=record, stop=stop, give_up=give_up,
                  drop=lambda: time.perf_counter() - started < DROP_BELOW_S)  # fmt: skip
        finally:
            flush()  # what was trained is recorded, also when the workload then raised
    except Dropped:
        steps = array.step - from_step
        note = (
            f"gave the device up {steps} steps into its unit: that progress was dropped "
            "(cheaper than checkpointing it); its trials go on from their checkpoints"
        )
        # with what the array said of how its members stacked (it was built), as a kept run's
        said = [*([array.warning] if array.warning else []), *array.notes]
        return [{"trials": [m.trial_id for m in todo], "stacks": [], "notes": [*said, note],
                 "failed": [], "gave_up": True, "dropped": True}]  # fmt: skip
    except Unspillable as exc:
        if spill_share > 1 and array.step == from_step:
            raise SpillAlone(str(exc)) from exc
        raise TrialError(exc) from exc
    except torch.cuda.OutOfMemoryError as exc:
        if budget is None:
            raise  # the pack is split, or its trial planned alone to train spilled
        raise TrialError(RuntimeError(f"out of memory even spilled: {exc}")) from exc
    except NOT_A_TRIAL_FAULT:
        raise
    except Exception as exc:
        raise TrialError(exc) from exc
    seconds = time.perf_counter() - started
    if stop is not None and stop.is_set():
        raise PackCancelled(f"pack {job.pack_id}: its study was cancelled")
    # staged, put in place by mark_done only where the database still takes the unit
    saved: dict[int, Staged] = {}
    try:
        for key in array.keys:
            state = array.member_state(key)
            saved[_id(key)] = stage_checkpoint(checkpoint_dir, study_of[_id(key)], key, state)
    except BaseException:
        for staged in saved.values():
            staged.discard()
        raise
    stopped_short = array.step < to_step and bool(array.groups)
    gave_up = give_up is not None and give_up.is_set() and stopped_short
    mark_done(job, saved, array.step / spe if gave_up else None)
    # the steady state's throughput: a compiled step's compilations are left out
    steady_steps = array.step - from_step - array.compile_steps
    steady_seconds = seconds - array.compile_seconds
    speed: dict[str, Any] = {}
    if steady_steps > 0 and steady_seconds > 0 and budget is None:
        if not shared:
            value = k * steady_steps / steady_seconds
            retrying(
                lambda s: store.record_throughput(s, job.workload, job.fusion_key, kind, k, value)
            )
        elif not array.compile_seconds and not gave_up:
            # the pack's reading of its arrays at once (worker.jobs adds them up)
            speed = {SPEED: {"trial_steps": k * steady_steps, "start": started,
                             "end": started + seconds, "k": k}}  # fmt: skip
    notes = [*([array.warning] if array.warning else []), *array.notes, *array.spill_notes()]
    if gave_up:
        notes.append(
            f"gave the device up after epoch {array.step / spe:g} of {job.to_resource:g}: a "
            "study with a better fair share was waiting; its trials go on from there"
        )
    return [
        {
            "trials": [m.trial_id for m in todo],
            "stacks": [{**stack, "trials": [_id(key) for key in stack["trials"]]}
                       for stack in array.stack_records()],
            "notes": notes,
            "failed": [],
            "gave_up": gave_up,
            **speed,
        }
    ]  # fmt: skip
