"""``run_pack(pack_id)``: the job that trains. RQ workers and the embedded runner both call
it (and ``run_check(check_id)``, a workload check asked for through the API).

It claims the pack (a pack already taken, finished or cancelled is left
alone), trains each fused array of the pack from its from-resource to its
to-resource (several arrays at once, in threads, where :func:`array_threads`
allows), writes a measurement per epoch per trial, checkpoints every
surviving trial at the end of its unit, and closes the pack. Outcomes:

- ``completed``: every unit done (diverged trials are marked and left out);
- ``split``: CUDA out of memory — the pack is replaced by two halves and the
  memory model for its fusion key is raised; no trial fails for it;
- back to ``pending`` (the scheduler re-dispatches, counting attempts) for
  failures that are not a trial's own: a database lost for over a minute
  (every write is tried again until then), a killed process...

A trial whose workload raises is found by re-running its array one member at
a time; that trial fails with the error kept and its pack-mates go on.

Run again for a finished pack, it changes nothing; after a crash it resumes
from the checkpoints (a unit whose checkpoint was written but not recorded
is recognised by its step count and not trained twice).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import sys
import threading
import time
import traceback
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from sqlalchemy.orm import Session

from packtune.errors import DeviceUnavailable, QueueUnavailable, StoreUnavailable, error_cause
from packtune.packing import MemoryModel, split_for_threads, split_in_two
from packtune.rungs import rung_resource
from packtune.settings import WORKER_NAME_ENV, default_torch_threads, get_settings
from packtune.spec import StoredSpec, TrainingSettings
from packtune.tuning import (
    CANCEL_CHECK_SECONDS,
    CPU_SPLIT_MIN,
    GPU_ARRAY_THREADS,
    YIELD_CHECK_SECONDS,
)
from service import store
from service.db import DATABASE_ERRORS, retrying
from service.models import CheckStatus, PackStatus, StudyStatus, TrialStatus
from worker.execute import (
    SPEED,
    ArrayJob,
    ArrayRun,
    MemberJob,
    PackCancelled,
    SpillAlone,
    TrialError,
    is_profiled,
    run_array,
    spill_budget,
)
from worker.gpu import device_label
from worker.probe import UnseenDraws

log = logging.getLogger(__name__)


class InjectedOutOfMemory(torch.cuda.OutOfMemoryError):
    """Raised by the ``PACKTUNE_OOM_ABOVE`` fault injection."""


def device_problem(setting: str) -> str | None:
    """Why the device ``setting`` (``PACKTUNE_DEVICE``) names cannot be used here; None
    where it can."""
    if setting == "cuda" and not torch.cuda.is_available():
        why = "a build without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        return (
            f"PACKTUNE_DEVICE=cuda, but torch {torch.__version__} has no GPU to train on "
            f"({why}); set PACKTUNE_DEVICE=auto or cpu"
        )
    return None


def pick_device() -> torch.device:
    """The device this process trains on, as the settings say (:class:`DeviceUnavailable`
    where they name one that is not there), with torch's threads and TF32 set."""
    settings = get_settings()
    problem = device_problem(settings.device)
    if problem is not None:
        raise DeviceUnavailable(problem)
    # Small models gain nothing from many threads, and on a busy 2-core box two torch
    # threads fighting the scheduler for a core ran ~10x slower than one.
    torch.set_num_threads(settings.torch_threads or default_torch_threads())
    allow_tf32(settings.tf32)
    if settings.device == "cuda" or (settings.device == "auto" and torch.cuda.is_available()):
        from worker.gpu import warn_if_cuda_without_nvml

        warn_if_cuda_without_nvml()
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def allow_tf32(setting: bool | None) -> None:
    """TensorFloat-32 for matmuls and cuDNN convolutions as ``setting`` says (None: leave
    torch's defaults)."""
    if setting is not None:
        torch.backends.cuda.matmul.allow_tf32 = setting
        torch.backends.cudnn.allow_tf32 = setting


def device_kind(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _load(pack_id: int, worker: str, device: torch.device) -> list[ArrayJob] | None:
    """Claim the pack and read what its arrays need; None when there is nothing to do."""
    job_id = current_job_id()
    return retrying(lambda s: _claim(s, pack_id, worker, device, job_id))


def current_job_id() -> str | None:
    """The id of the RQ job running this code (None outside one: the embedded runner's
    jobs die with their scheduler, so none of them outlives a dispatch)."""
    rq = sys.modules.get("rq")  # imported by an RQ worker; not imported for this
    job = rq.get_current_job() if rq is not None else None
    return None if job is None else str(job.id)


def _claim(
    s: Session, pack_id: int, worker: str, device: torch.device, job_id: str | None = None
) -> list[ArrayJob] | None:
    # named as the planner names it, or its running pack would not count on that device
    label = device_label(worker, device)
    pack = store.claim_pack(s, pack_id, worker_name=worker, device=label, job_id=job_id)
    if pack is None:
        return None
    # members still queued, or running from an earlier run of this job, at the unit's start;
    # not those cancelled, finished by an earlier attempt, or moved on to another pack
    members = store.unfinished_members(s, pack)
    trials = {t.id: t for t in store.trials_by_id(s, [m.trial_id for m in pack.members])}
    if not members and store.finished_before(pack, trials):
        # an earlier attempt trained every unit and its process died before closing the
        # pack (e.g. killed between its units' ends and this): the work is done
        store.finish_pack(s, pack, PackStatus.completed)
        return None
    studies = {i: store.get_study(s, i) for i in sorted({t.study_id for t in trials.values()})}
    ended = (StudyStatus.cancelled, StudyStatus.failed, StudyStatus.completed)
    live = {i: study for i, study in studies.items() if study.status not in ended}
    members = [m for m in members if trials[m.trial_id].study_id in live]
    if not members:
        gone = sorted({study.status.value for study in studies.values() if study.id not in live})
        why = f"study {', '.join(gone)}" if gone else "its trials were stopped before it ran"
        store.finish_pack(s, pack, PackStatus.cancelled, error=why)
        return None
    specs = {i: StoredSpec.of(study.spec) for i, study in live.items()}
    store.move_trials(s, sorted({m.trial_id for m in members}), TrialStatus.running)
    trials = {t.id: t for t in store.trials_by_id(s, [m.trial_id for m in members])}
    groups: dict[tuple[str, float, float, int, str, int, int], list[MemberJob]] = defaultdict(list)
    training: dict[str, TrainingSettings] = {}
    for m in members:
        trial = trials[m.trial_id]
        if trial.status != TrialStatus.running:
            continue
        study, spec = live[trial.study_id], specs[trial.study_id]
        training[spec.training.lane] = spec.training
        # studies of other horizons share an array: a schedule is its member's own; a key's
        # units in several arrays (the planner's cut by the measured array size) train apart
        key = (m.fusion_key, m.from_resource, m.to_resource, study.seed, spec.training.lane,
               m.segment, m.array_no)  # fmt: skip
        groups[key].append(
            MemberJob(
                trial_id=trial.id,
                sample_index=trial.sample_index,
                config=dict(trial.config),
                resource_done=trial.resource_done,
                checkpoint_path=trial.checkpoint_path,
                rung_resource=rung_resource(spec, trial.bracket, trial.rung),
                study_id=study.id,
                study_seed=study.seed,
                metric=spec.objective.metric,
                horizon=float(spec.hyperband.max_resource),
            )
        )
    return [
        ArrayJob(
            pack_id=pack_id,
            data_seed=seed,
            workload=live[group[0].study_id].workload,
            fusion_key=key,
            from_resource=start,
            to_resource=end,
            members=group,
            training=training[lane],
            segment=segment,
        )
        for (key, start, end, seed, lane, segment, _), group in sorted(groups.items())
    ]


def run_check(check_id: int) -> str:
    """Run workload check ``check_id`` (``POST /api/workloads/{name}/check``) on this worker's
    device and store its report; returns the check's final status."""
    from worker.check import check, error_line

    worker = os.environ.get(WORKER_NAME_ENV) or f"embedded@{socket.gethostname()}"
    row = retrying(lambda s: _started_check(s, check_id, worker))
    if row is None:
        return "skipped"
    workload, request = row
    seconds = get_settings().check_seconds  # packs wait behind a check: it stops past it
    stop = threading.Event()
    timer = threading.Timer(seconds, stop.set)
    timer.daemon = True
    timer.start()
    try:
        report = check(
            workload, request.get("space"), members=int(request.get("members", 4)),
            steps=int(request.get("steps", 5)), device=str(pick_device()), stop=stop,
            seconds=seconds,
        )  # fmt: skip
    except Exception as exc:  # the workload raised: the check's answer, not the job's failure
        log.warning("workload check %s (%s) could not run: %s", check_id, workload, exc)
        error = error_line(exc)
        retrying(lambda s: store.finish_check(s, check_id, CheckStatus.error, error=error))
        return CheckStatus.error.value
    finally:
        timer.cancel()
    status = CheckStatus.passed if report.ok else CheckStatus.failed
    body = report.as_json()
    retrying(lambda s: store.finish_check(s, check_id, status, report=body))
    return status.value


def _started_check(s: Session, check_id: int, worker: str) -> tuple[str, dict[str, Any]] | None:
    check = store.start_check(s, check_id, worker)
    return None if check is None else (check.workload, dict(check.request))


def run_pack(pack_id: int) -> str:
    """Train pack ``pack_id``; returns its outcome (also written to the database)."""
    settings = get_settings()
    worker = os.environ.get(WORKER_NAME_ENV) or f"embedded@{socket.gethostname()}"
    device = pick_device()
    arrays = _load(pack_id, worker, device)
    if arrays is None:
        return "skipped"
    kind = device_kind(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    watch = PackWatch(pack_id, {m.study_id for a in arrays for m in a.members})
    try:
        size = sum(len(a.members) for a in arrays)
        if settings.oom_above is not None and size > settings.oom_above:
            raise InjectedOutOfMemory(f"injected: {size} trials > PACKTUNE_OOM_ABOVE")
        runs = _run_arrays(arrays, device, kind, settings.checkpoint_dir, watch.stop, watch.give_up)
    except PackCancelled as exc:
        log.info("%s; stopped at a step boundary", exc)
        retrying(lambda s: store.finish_pack(s, store.get_pack(s, pack_id), PackStatus.cancelled,
                                             error="its study was cancelled"))  # fmt: skip
        return "cancelled"
    except torch.cuda.OutOfMemoryError as exc:
        _split(pack_id, arrays, kind, device, f"{type(exc).__name__}: {exc}")
        return "split"
    except Exception as exc:
        log.exception("pack %s failed", pack_id)
        _back_to_pending(pack_id, exc)
        return "failed"
    finally:
        watch.close()
    peak = int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
    seconds = time.perf_counter() - started

    def finish(s: Session) -> bool:
        pack = store.get_pack(s, pack_id)
        ran = list(runs)
        # arrays that had not begun when the pack gave its device up: planned anew
        released = store.release_members(s, pack) if watch.give_up.is_set() else []
        reported = {t for run in ran for t in run["trials"]}  # dropped arrays say so
        released = [t for t in released if t not in reported]
        if released:
            note = "not begun: the pack gave its device up first; planned again"
            ran.append({"trials": released, "stacks": [], "notes": [note], "failed": [],
                        "gave_up": True})  # fmt: skip
        gave_up = any(run.get("gave_up") for run in ran)
        store.finish_pack(
            s, pack, PackStatus.completed, peak_bytes=peak, train_seconds=seconds, arrays=ran
        )
        if peak is not None and len(arrays) == 1 and not gave_up:
            _correct_memory(s, arrays[0], kind, len(arrays[0].members), peak)
        return gave_up

    if retrying(finish):
        log.info("pack %s gave its device up after %.2f s", pack_id, seconds)
        return "yielded"
    return "completed"


def array_threads(device: torch.device, arrays: int) -> int:
    """How many of a pack's ``arrays`` train at once (``PACKTUNE_ARRAY_THREADS``).

    A pack holds one array per fusion key and resource span, trained by default one at a
    time. Small models leave a GPU idle between the kernels one Python thread launches,
    and on a CPU a torch op runs on its calling thread when torch has one thread: threads
    then overlap what would wait. On a CPU with several torch threads per op, arrays go
    one after another (threads of ops that each use every core would only contend).
    """
    setting = get_settings().array_threads
    if setting is not None:
        return max(1, min(setting, arrays))
    if device.type == "cuda":
        return min(GPU_ARRAY_THREADS, arrays)
    return max(1, min(arrays, (os.cpu_count() or 1) // max(1, torch.get_num_threads())))


def _cut_for_threads(arrays: list[ArrayJob], device: torch.device, kind: str) -> list[ArrayJob]:
    """On a CPU, the pack's large arrays cut in halves while it has fewer arrays than
    :func:`array_threads` would train at once (:func:`packtune.packing.split_for_threads`,
    :data:`~packtune.tuning.CPU_SPLIT_MIN`): there an array's step costs about k times one
    trial's, so one large array would leave the other cores idle. Members train the same
    in any array, so only speed changes. Not for segment units, spilled arrays, or keys
    whose memory is not measured yet (their first run is a probe, alone)."""
    if device.type != "cpu" or any(a.segment >= 0 for a in arrays):
        return arrays
    slots = array_threads(device, sum(len(a.members) for a in arrays))
    if slots <= len(arrays) or max(len(a.members) for a in arrays) < 2 * CPU_SPLIT_MIN:
        return arrays
    if not all(is_profiled(a, kind) for a in arrays) or any(
        spill_budget(a, kind, device, len(a.members)) is not None for a in arrays
    ):
        return arrays
    of = {id(m): a for a in arrays for m in a.members}
    parts = split_for_threads([a.members for a in arrays], slots, CPU_SPLIT_MIN)
    return [dataclasses.replace(of[id(part[0])], members=part) for part in parts]


def _run_arrays(
    arrays: list[ArrayJob],
    device: torch.device,
    kind: str,
    ckpt_dir: Any,
    stop: threading.Event | None = None,
    give_up: threading.Event | None = None,
) -> list[ArrayRun]:
    """Train the pack's arrays, several at once where :func:`array_threads` allows and every
    fusion key's memory is already measured (a probe measures the device's peak memory,
    which another array training beside it would distort; so does the pack's first run of
    a key, planned small for that reason). Errors are raised once every array has stopped:
    an out-of-memory first, so that the pack is split."""
    arrays = _cut_for_threads(arrays, device, kind)
    threads = array_threads(device, len(arrays))
    if threads <= 1 or not all(is_profiled(a, kind) for a in arrays):
        return [
            run for array in arrays for run in _run_isolating(array, device, kind, ckpt_dir,
                                                              stop=stop, give_up=give_up)
        ]  # fmt: skip
    # spilled arrays (the planner packs up to SPILL_ALTERNATE together) alternate: each in
    # its share of the device, one's shard computing while another's is copied in
    spilled = sum(spill_budget(a, kind, device, len(a.members)) is not None for a in arrays)
    share = spilled if spilled > 1 else 1
    with ThreadPoolExecutor(threads, thread_name_prefix="packtune-array") as pool:
        futures = [
            pool.submit(_run_isolating, a, device, kind, ckpt_dir, True, stop, give_up, share)
            for a in arrays
        ]
    errors = [exc for f in futures if (exc := f.exception()) is not None]
    alone = [a for a, f in zip(arrays, futures, strict=True)
             if isinstance(f.exception(), SpillAlone)]  # fmt: skip
    errors = [exc for exc in errors if not isinstance(exc, SpillAlone)]
    oom = [exc for exc in errors if isinstance(exc, torch.cuda.OutOfMemoryError)]
    if errors:
        raise (oom or errors)[0]
    runs = [run for f in futures if f.exception() is None for run in f.result()]
    _record_at_once(arrays, runs, kind)
    for array in alone:  # a layer too large for a share: the device to itself, in turn
        runs += _run_isolating(array, device, kind, ckpt_dir, True, stop, give_up)
    return runs


def _record_at_once(arrays: list[ArrayJob], runs: list[ArrayRun], kind: str) -> None:
    """Fold the pack's trial-steps/s into its fusion key's curve of arrays trained at once
    (``profiles.concurrent``, under the largest array's size), where the arrays trained in
    threads are all of one key, at least two of them of about that size (half of it or
    more: the size the planner cut them to; the rest of the key's units make a smaller
    one), and every one reported its speed (none gave up, spilled, failed or compiled); the
    speed entries are taken out of ``runs`` either way. The reading is the whole pack's:
    every array's trial-steps over the time from the first array's start to the last one's
    end, a tail with fewer arrays training included."""
    speeds = [run.pop(SPEED) for run in runs if SPEED in run]
    keys = {(a.workload, a.fusion_key) for a in arrays}
    if len(keys) != 1 or len(speeds) != len(arrays) or len(arrays) < 2:
        return
    k = max(speed["k"] for speed in speeds)
    span = max(speed["end"] for speed in speeds) - min(speed["start"] for speed in speeds)
    if sum(2 * speed["k"] >= k for speed in speeds) < 2 or span <= 0:
        return
    value = sum(speed["trial_steps"] for speed in speeds) / span
    ((workload, key),) = keys
    retrying(lambda s: store.record_throughput(s, workload, key, kind, k, value, concurrent=True))


def _run_isolating(
    array: ArrayJob,
    device: torch.device,
    kind: str,
    ckpt_dir: Any,
    shared: bool = False,
    stop: threading.Event | None = None,
    give_up: threading.Event | None = None,
    spill_share: int = 1,
) -> list[ArrayRun]:
    """Run an array; if the workload raises, run its members one by one to find the culprit.
    Returns how it ran, the trials failed included."""
    ids = [m.trial_id for m in array.members]
    try:
        return run_array(array, device, kind, ckpt_dir, shared, stop, give_up, spill_share)
    except TrialError as exc:
        if len(array.members) == 1 or exc.culprits >= set(ids):
            _fail_trials(ids, exc.text)
            return [{"trials": ids, "stacks": [], "notes": [], "failed": ids}]
        log.warning("array of %d raised (%s); isolating members", len(array.members), exc.text)
        stacks: list[Any] = []
        failed: list[int] = []
        for member in array.members:
            try:
                for run in run_array(
                    array.alone(member),
                    device,
                    kind,
                    ckpt_dir,
                    shared,
                    stop,
                    give_up,
                    spill_share,
                ):
                    stacks += run["stacks"]
            except TrialError as solo:
                _fail_trials([member.trial_id], solo.text)
                failed.append(member.trial_id)
        cause = error_cause(exc.text)
        note = f"the fused array raised ({cause}); its members then ran one at a time"
        return [{"trials": ids, "stacks": stacks, "notes": [note], "failed": failed}]


#: set to make the running pack's watch look at once (the embedded runner's scheduler sets
#: the multiprocessing event that :func:`listen_for_nudges` puts here)
_nudges: Any = threading.Event()


def listen_for_nudges(event: Any) -> None:
    """In the embedded runner: ``event``, set by the scheduler when it asks a pack to give
    its device up, wakes the running pack's watch."""
    global _nudges
    _nudges = event


def nudge_watches() -> None:
    """Make the running packs' watches of this process look at once (what the embedded
    runner's scheduler does through the event :func:`listen_for_nudges` installs)."""
    _nudges.set()


class PackWatch:
    """Watches a running pack from a thread of its own:

    - ``stop`` is set once every study of the pack is cancelled (or ended otherwise), read
      every :data:`~packtune.tuning.CANCEL_CHECK_SECONDS`, so that the pack stops at its
      next step boundary instead of training to its end. A pack shared with a study that
      goes on trains to its end (what it wrote for a cancelled study's trials is not kept:
      they are cancelled).
    - ``give_up`` is set once the scheduler asks the pack to give its device up
      (``packs.yield_requested_at``, read every :data:`~packtune.tuning.YIELD_CHECK_SECONDS`,
      and at once when the embedded runner's scheduler nudges it): its arrays stop at their
      next training step.
    """

    def __init__(self, pack_id: int, study_ids: set[int]) -> None:
        self.pack_id, self.study_ids = pack_id, study_ids
        self.stop, self.give_up, self._closed = (
            threading.Event(), threading.Event(), threading.Event()
        )  # fmt: skip
        self._thread = threading.Thread(target=self._run, name="packtune-watch", daemon=True)
        self._thread.start()

    def _look_for_yield(self) -> None:
        try:
            if retrying(lambda s: store.yield_requested(s, self.pack_id)):
                self.give_up.set()
        except Exception as exc:  # the database is away: train on, look again later
            log.debug("pack watch: %s", exc)

    def _run(self) -> None:
        ended = (StudyStatus.cancelled, StudyStatus.failed, StudyStatus.completed)
        last_study_look = time.monotonic()
        while True:
            _nudges.wait(YIELD_CHECK_SECONDS)
            if self._closed.is_set():
                return
            _nudges.clear()  # before the read: a nudge from now on wakes the next look
            if not self.give_up.is_set():
                self._look_for_yield()
            if time.monotonic() - last_study_look < CANCEL_CHECK_SECONDS:
                continue
            last_study_look = time.monotonic()
            try:
                statuses = retrying(
                    lambda s: [store.get_study(s, i).status for i in sorted(self.study_ids)]
                )
            except Exception as exc:  # the database is away: train on, look again later
                log.debug("pack watch: %s", exc)
                continue
            if all(status in ended for status in statuses):
                self.stop.set()
                return

    def close(self) -> None:
        self._closed.set()
        _nudges.set()  # wakes this watch now (the next pack's watch then looks once at once)
        self._thread.join(timeout=5)


def _fail_trials(trial_ids: list[int], error: str) -> None:
    def write(s: Session) -> None:
        store.move_trials(s, trial_ids, TrialStatus.failed, error=error)

    retrying(write)


def _correct_memory(s: Any, array: ArrayJob, kind: str, k: int, peak: int) -> None:
    profile = store.get_profile(s, array.workload, array.fusion_key, kind)
    if profile is None or profile.base_bytes is None or profile.per_trial_bytes is None:
        return
    model = MemoryModel(int(profile.base_bytes), int(profile.per_trial_bytes)).corrected(k, peak)
    store.set_memory_model(s, array.workload, array.fusion_key, kind, model.base, model.per_trial)


def _split(
    pack_id: int, arrays: list[ArrayJob], kind: str, device: torch.device, error: str
) -> None:
    """CUDA out of memory: replace the pack by two halves of its unfinished units."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        capacity = int(torch.cuda.mem_get_info(device)[0])
    else:
        capacity = get_settings().cpu_memory_budget
    retrying(lambda s: _split_pack(s, pack_id, arrays, kind, capacity, error))


def _split_pack(
    s: Session, pack_id: int, arrays: list[ArrayJob], kind: str, capacity: int, error: str
) -> None:
    pack = store.get_pack(s, pack_id)
    if pack.status == PackStatus.split:
        return  # an earlier try went through, but the connection broke before it heard so
    units = store.unfinished_members(s, pack, (TrialStatus.running,))
    ids = sorted({u.trial_id for u in units})
    held = store.trained_elsewhere(s, pack, ids)  # a trial's other segment unit, running
    store.move_trials(s, [t for t in ids if t not in held], TrialStatus.queued)
    workloads = {array.fusion_key: array.workload for array in arrays}
    for key in {u.fusion_key for u in units}:
        workload = workloads.get(key) or key.split("|", 1)[0]  # a key starts with its workload
        k = sum(u.fusion_key == key for u in units)
        profile = store.get_profile(s, workload, key, kind)
        base = int(profile.base_bytes or 0) if profile else 0
        per = int(profile.per_trial_bytes or 1) if profile else 1
        raised = MemoryModel(base, per).after_oom(k, capacity)
        store.set_memory_model(s, workload, key, kind, raised.base, raised.per_trial)
    if len(units) == 1 and get_settings().spill and units[0].segment < 0:
        # its memory model now exceeds the device alone: the planner gives it a device of
        # its own and the worker trains it spilled (an out-of-memory while spilled fails it)
        store.move_trials(s, [units[0].trial_id], TrialStatus.pending)
        store.finish_pack(
            s, pack, PackStatus.split, error=f"{error}; planned again alone, to train spilled"
        )
        return
    if len(units) < 2:
        store.move_trials(
            s, [u.trial_id for u in units], TrialStatus.failed,
            error=f"out of memory even alone on {kind}: {error}",
        )  # fmt: skip
        store.finish_pack(s, pack, PackStatus.failed, error=error)
        return
    for half in split_in_two(units):  # its members keep their arrays (the planner's cut)
        store.create_pack(
            s, study_id=pack.study_id, parent_id=pack.id,
            members=[(u.trial_id, u.fusion_key, u.from_resource, u.to_resource, u.segment,
                      u.array_no) for u in half],
        )  # fmt: skip
    store.finish_pack(s, pack, PackStatus.split, error=error)


#: what fails a pack through no fault of its trials: storage (a full or read-only checkpoint
#: folder), the database, the job queue. Such attempts do not count toward max_attempts.
NOT_THE_TRIALS: tuple[type[BaseException], ...] = (
    OSError,
    *DATABASE_ERRORS,
    QueueUnavailable,
    UnseenDraws,
)


def _back_to_pending(pack_id: int, exc: BaseException) -> None:
    """A failure that is not a trial's own: let the scheduler try the pack again, after a
    backoff; a fault of :data:`NOT_THE_TRIALS` does not use up an attempt."""
    error = f"{type(exc).__name__}: {exc}"
    fault = isinstance(exc, NOT_THE_TRIALS)

    def write(s: Session) -> None:
        pack = store.get_pack(s, pack_id)
        store.requeue_pack(s, pack, error=error, fault=fault, backoff=get_settings().retry_backoff)

    try:
        retrying(write)
    except StoreUnavailable:
        # the database is gone too: the scheduler sees the job end without finishing the pack
        log.error("could not record the failure of pack %s: %s", pack_id, traceback.format_exc())
