"""Segment units: one segment of an array's decoupled trials trained over their rung span,
as a unit of work of its own (a study's ``training: {mode: decoupled, units: segment}``).

The scheduler plans each segment of a trial's span as a pack member of its own
(``pack_members.segment``), fused with the same segment of other trials, on any device: a
trial's segments may train at once on several devices, since they exchange nothing while
they train (:mod:`worker.decoupled`). A segment unit

1. starts from the trial's checkpoint at the span's start (the composed model: every
   segment's weights), trains its segment alone to the span's end, and saves that
   segment's part to a checkpoint of its own (``trial-<id>.segment<j>.pt``);
2. then looks at its trials' other segments: a trial whose every segment's checkpoint is at
   the span's end is *finished* here: its segments' states are merged into the trial's
   checkpoint (:func:`worker.decoupled.merge_segments`), the composed model is evaluated,
   the measurement recorded at the span's end and the trial moved on (paused at its rung,
   or pending), as an array that trains every segment would.

Whichever of a trial's units ends last finishes it (both may, when two end at once: the
merge, the evaluation and the measurement are the same, and the trial moves once, from
``running``). Crash-safe by the checkpoints: a unit run again finds its segment already at
the span's end and only tries to finish; a trial whose merged checkpoint is at the span's
end but whose move was lost is finished again by its next unit to run. Per-epoch metrics
are not recorded (a lone segment is not the trial's model): the trial's curve has a point
at each rung, and ``train_loss`` there is its last segment's.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from packtune.checkpoints import checkpoint_path
from packtune.workloads import get_workload
from packtune.workloads.base import data_splits
from service import store
from service.db import retrying
from service.models import TrialStatus
from worker.checkpoints import load_checkpoint, save_checkpoint
from worker.decoupled import merge_segments
from worker.execute import (
    NOT_A_TRIAL_FAULT,
    ArrayJob,
    ArrayRun,
    MemberJob,
    ObjectiveNotReported,
    PackCancelled,
    TrialError,
    _id,
    check_objective_reported,
    ensure_profile,
    mark_done,
    member_checkpoint,
    span_steps,
    spill_budget,
    workload_steps,
)
from worker.fused import FusedArray, Report, train
from worker.rng import GLOBAL_RNG


def _segment_name(trial_id: int, segment: int, step: int) -> str:
    """The checkpoint name of segment ``segment``'s part of a trial at global step ``step``
    (the span's end), kept until the trial's checkpoint has it: named by the step, so that
    whether a segment has ended a span is whether its file exists (nothing to read)."""
    return f"{trial_id}.segment{segment}.step{step}"


def segment_path(directory: Any, study_id: int, trial_id: int, segment: int, step: int) -> Path:
    """Where :func:`_segment_name`'s part lies."""
    return checkpoint_path(directory, study_id, _segment_name(trial_id, segment, step))


def run_segment_array(
    job: ArrayJob,
    device: torch.device,
    kind: str,
    checkpoint_dir: Path,
    stop: Any = None,
    loaded: Any = None,
) -> list[ArrayRun]:
    """Train segment ``job.segment`` of ``job``'s trials over the span, then finish the
    trials whose every segment has ended it (see the module). ``loaded``: the workload's
    data, where the caller has loaded it already."""
    workload = get_workload(job.workload)
    segment = job.segment
    configs = {m.trial_id: job.config(m) for m in job.members}
    first = workload.resolve(next(iter(configs.values())))
    from_step, to_step = span_steps(job, workload_steps(workload, first))
    # the workload's data, loaded once for training and evaluation, and only if either runs
    data = functools.cache(
        lambda: loaded if loaded is not None else data_splits(workload, first, device)
    )
    todo: list[MemberJob] = []
    states: list[dict[str, Any] | None] = []
    ended: list[MemberJob] = []
    mains: dict[int, dict[str, Any] | None] = {}  # each trial's checkpoint, as loaded
    for m in job.members:
        own = segment_path(checkpoint_dir, m.study_id, m.trial_id, segment, to_step)
        state, trained = member_checkpoint(m, from_step, to_step, own.exists())
        mains[m.trial_id] = state
        if trained:
            ended.append(m)  # merged, or this segment trained, by a run that died since
        else:
            todo.append(m)
            states.append(state)
    runs: list[ArrayRun] = []
    parts: dict[int, dict[str, Any]] = {}  # this segment's part of each trial it trained
    if todo:
        run, parts = _train(job, todo, states, device, kind, checkpoint_dir, to_step, stop, data)
        runs.append(run)
        ended += [m for m in todo if m.trial_id in parts]
    finished = finish_spans(job, ended, device, checkpoint_dir, to_step, mains, parts, data)
    if finished:
        note = f"finished trials {finished}: every segment had ended the span"
        if runs:
            runs[-1]["notes"].append(note)
        else:
            runs.append({"trials": finished, "stacks": [], "notes": [note], "failed": []})
    for run in runs:
        run["segment"] = segment
    return runs


def _train(
    job: ArrayJob,
    todo: list[MemberJob],
    states: list[dict[str, Any] | None],
    device: torch.device,
    kind: str,
    checkpoint_dir: Path,
    to_step: int,
    stop: Any,
    data: Callable[[], Any],
) -> tuple[ArrayRun, dict[int, dict[str, Any]]]:
    """Train the segment of ``todo``'s trials and save its part of each; returns how the
    array ran and the parts saved (of the trials that did not diverge)."""
    workload = get_workload(job.workload)
    configs = {m.trial_id: job.config(m) for m in todo}
    first = workload.resolve(next(iter(configs.values())))
    try:
        ensure_profile(job, first, device, kind, data())
        with GLOBAL_RNG:  # a segment over the device is refused there, as a trial unit is
            array = FusedArray(
                workload, [(m.trial_id, configs[m.trial_id]) for m in todo], device=device,
                states=states, data=data(), training=job.training, segment=job.segment,
                spill_budget=spill_budget(job, kind, device, len(todo)),
            )  # fmt: skip
        if array.stochastic:
            raise ValueError(
                f"{workload.name}'s model draws random numbers (dropout): a segment unit "
                "starts from the trial's random state, so its draws would not be those of "
                "units: trial; use units: trial for it"
            )
    except NOT_A_TRIAL_FAULT:
        raise
    except Exception as exc:
        raise TrialError(exc) from exc
    member = {m.trial_id: m for m in todo}
    spe = array.steps_per_epoch

    def diverged(report: Report) -> None:
        if not report.diverged:
            return

        def write(s: Any) -> None:
            for key in report.diverged:
                trial_id = _id(key)
                step = array.diverged[key]
                store.record_measurement(s, trial_id, step / spe, {"train_loss": math.nan},
                                         metric=member[trial_id].metric)  # fmt: skip
                store.move_trials(s, [trial_id], TrialStatus.diverged,
                                  error=f"segment {job.segment}'s loss became non-finite at "
                                        f"step {step}")  # fmt: skip

        retrying(write)

    try:
        with GLOBAL_RNG if array.stochastic else nullcontext():
            reports = train(array, to_step, on_report=diverged, stop=stop)
    except NOT_A_TRIAL_FAULT:
        raise
    except Exception as exc:
        raise TrialError(exc) from exc
    if stop is not None and stop.is_set():
        raise PackCancelled(f"pack {job.pack_id}: its study was cancelled")
    losses = reports[-1].metrics if reports else {}
    parts = {}
    for key in array.keys:
        m = member[_id(key)]
        state = array.member_state(key)
        state["train_loss"] = float(losses.get(key, {}).get("train_loss", math.nan))
        save_checkpoint(checkpoint_dir, m.study_id,
                        _segment_name(m.trial_id, job.segment, to_step), state)  # fmt: skip
        parts[m.trial_id] = state
    return {
        "trials": [m.trial_id for m in todo],
        "stacks": [{"trials": [_id(k) for k in keys], "mode": mode} for keys, mode in array.stacks],
        "notes": [*([array.warning] if array.warning else []), *array.notes],
        "failed": [],
    }, parts


def finish_spans(
    job: ArrayJob,
    members: list[MemberJob],
    device: torch.device,
    checkpoint_dir: Path,
    to_step: int,
    mains: dict[int, dict[str, Any] | None],
    own: dict[int, dict[str, Any]],
    data: Callable[[], Any],
) -> list[int]:
    """Finish the ``members`` whose every segment is at ``to_step``: merge, evaluate the
    composed model, record the measurement at the span's end, move the trial on. Returns
    the trials finished. ``mains``: the trials' checkpoints as this unit loaded them;
    ``own``: this unit's segment's part of the trials it trained (not read back);
    ``data()``: the workload's data."""
    segments = job.training.segments
    ready: list[tuple[MemberJob, dict[str, Any]]] = []
    paths: dict[int, str] = {}
    for m in members:
        state = mains.get(m.trial_id)
        if state is not None and int(state["steps_done"]) == to_step:
            ready.append((m, state))  # merged by a unit whose move was lost
            paths[m.trial_id] = str(m.checkpoint_path)
            continue
        files = [segment_path(checkpoint_dir, m.study_id, m.trial_id, j, to_step)
                 for j in range(segments)]  # fmt: skip
        if not all(j == job.segment and m.trial_id in own or f.exists()
                   for j, f in enumerate(files)):  # fmt: skip
            continue  # another segment is still on its way
        parts = [own[m.trial_id] if j == job.segment and m.trial_id in own
                 else load_checkpoint(f, mmap=True) for j, f in enumerate(files)]  # fmt: skip
        if any(p is None for p in parts):
            continue  # finished and cleared by another unit meanwhile
        merged = merge_segments([p for p in parts if p is not None])
        now = load_checkpoint(checkpoint_path(checkpoint_dir, m.study_id, m.trial_id), mmap=True)
        if now is not None and int(now["steps_done"]) > to_step:
            continue  # finished by another unit, and on its next span already: not ours
        # the trial's checkpoint first: a unit that dies after it finishes from it again
        paths[m.trial_id] = str(save_checkpoint(checkpoint_dir, m.study_id, m.trial_id, merged))
        ready.append((m, merged))
    if not ready:
        return []
    workload = get_workload(job.workload)
    try:
        with GLOBAL_RNG:
            array = FusedArray(
                workload, [(m.trial_id, job.config(m)) for m, _ in ready], device=device,
                states=[state for _, state in ready], data=data(), training=job.training,
            )  # fmt: skip
            evaluated = array.evaluate()
    except NOT_A_TRIAL_FAULT:
        raise
    except Exception as exc:
        raise TrialError(exc) from exc
    rows: dict[str, list[tuple[int, float, dict[str, float]]]] = {}
    measured: dict[int, tuple[str, dict[str, float]]] = {}
    for m, state in ready:
        metrics = {"train_loss": float(state.get("train_loss", math.nan)),
                   **evaluated[m.trial_id]}  # fmt: skip
        measured[m.trial_id] = (m.metric, metrics)
        rows.setdefault(m.metric, []).append((m.trial_id, job.to_resource, metrics))
    try:
        check_objective_reported(job.workload, measured)
    except ObjectiveNotReported as exc:
        raise TrialError(exc) from exc

    def write(s: Any) -> None:
        for name, batch in rows.items():
            store.record_measurements(s, batch, metric=name)

    retrying(write)
    moved = mark_done(job, paths)
    for m, _ in ready:  # the trial's checkpoint has them now, and its row says so
        if m.trial_id not in moved:
            continue  # not moved (queued again meanwhile): the next unit finishes it from them
        for j in range(segments):
            segment_path(checkpoint_dir, m.study_id, m.trial_id, j, to_step).unlink(missing_ok=True)
    return sorted(paths)
