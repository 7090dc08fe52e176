"""Studies with progress, trial counts, the best trial and the best so far."""

from __future__ import annotations

import math
from collections import defaultdict

from sqlalchemy import distinct, func, select
from sqlalchemy.orm import Session

from packtune.fleet import StudyLoad, covered_seconds, entitled_shares
from packtune.iterations import planned_units
from packtune.rungs import rung_resource
from packtune.spec import StoredSpec
from service import store
from service.models import (
    Pack,
    PackMember,
    PackStatus,
    Study,
    StudyStatus,
    Trial,
    TrialStatus,
    utcnow,
)
from service.queries.rows import UNIT_FINISHED, Row
from service.queries.trials import top_trials, trials_by_id

# -- studies ------------------------------------------------------------------------------


def study_summary(s: Session, study_id: int) -> Row:
    """One study with progress, trial counts, its best trial and the best so far."""
    study = store.get_study(s, study_id)
    summary = _summaries(s, [study])[0]
    board = top_trials(s, study_id, limit=1)
    summary["best_so_far"] = board[0] if board else None
    return summary


def list_studies(
    s: Session, limit: int, offset: int, status: list[StudyStatus] | None = None
) -> tuple[list[Row], int]:
    """A page of studies, newest first, and how many there are (in ``status``, if given)."""
    rows, count = store.list_studies(s, limit=limit, offset=offset, status=status)
    return _summaries(s, list(rows), with_spec=False), count


def _summaries(s: Session, studies: list[Study], with_spec: bool = True) -> list[Row]:
    """Each study's summary; ``with_spec``: its whole spec too (a study's own page needs it;
    a list of studies does not, and a large search space would be repeated in every row)."""
    ids = [study.id for study in studies]
    counts: dict[int, dict[str, int]] = defaultdict(dict)
    done: dict[int, int] = defaultdict(int)
    failed: dict[int, int] = defaultdict(int)  # of ``done``: a failed trial's last unit
    stmt = (
        select(
            Trial.study_id,
            Trial.status,
            func.count(),
            func.coalesce(func.sum(Trial.rung), 0),
        )
        .where(Trial.study_id.in_(ids))
        .group_by(Trial.study_id, Trial.status)
    )
    for study_id, status, n, rungs in s.execute(stmt):
        counts[study_id][TrialStatus(status).value] = n
        done[study_id] += int(rungs) + (n if status in UNIT_FINISHED else 0)
        if status == TrialStatus.failed:
            failed[study_id] += n
    for study_id, extra in _cancelled_units(s, studies).items():
        done[study_id] += extra
    running: dict[int, int] = defaultdict(int)
    packs_stmt = (  # through the members: a pack may train trials of several studies
        select(Trial.study_id, func.count(distinct(Pack.id)))
        .join(PackMember, PackMember.pack_id == Pack.id)
        .join(Trial, Trial.id == PackMember.trial_id)
        # its trials that still train there: a pack shared with another study runs on
        # after this one's members ended (its study completed, "1 packs running")
        .where(
            Trial.study_id.in_(ids),
            Pack.status == PackStatus.running,
            Trial.status.in_((TrialStatus.queued, TrialStatus.running)),
        )
        .group_by(Trial.study_id)
    )
    for study_id, n in s.execute(packs_stmt):
        running[study_id] = n
    iterations_stmt = (
        select(Trial.study_id, func.max(Trial.iteration))
        .where(Trial.study_id.in_(ids))
        .group_by(Trial.study_id)
    )
    iterations = {study_id: int(top) + 1 for study_id, top in s.execute(iterations_stmt)}
    best = trials_by_id(s, [st.best_trial_id for st in studies if st.best_trial_id is not None])
    fleet = _fleet(s, studies)
    out = []
    for study in studies:
        spec = StoredSpec.of(study.spec)
        metric, mode = spec.objective.metric, spec.objective.mode
        started = iterations.get(study.id, 0)
        budget = spec.budget
        # every iteration a count allows (up to max_trials); with only time or a target:
        # those started
        planned = budget.iterations()
        if budget.max_iterations is None and budget.max_trials is None and planned > 1:
            planned = max(1, started)
        total = planned_units(spec.brackets, int(spec.hyperband.eta), spec.scheduler == "asha",
                              planned, budget.max_trials)  # fmt: skip
        finished = min(done[study.id], total)
        if study.status == StudyStatus.completed:  # the bar is full, at the units trained
            finished = total = done[study.id]
        best_row = best.get(study.best_trial_id) if study.best_trial_id is not None else None
        out.append(
            {
                "id": study.id,
                "name": study.name,
                "workload": study.workload,
                "status": study.status.value,
                "seed": study.seed,
                "objective": {"metric": metric, "mode": mode},
                "spec": study.spec if with_spec else None,
                "error": study.error,
                "created_at": study.created_at,
                "started_at": study.started_at,
                "finished_at": study.finished_at,
                "progress": {"done": finished, "total": total, "failed": failed[study.id]},
                "budget": _budget(study, spec, started, sum(counts[study.id].values())),
                "trial_counts": counts[study.id],
                "packs_running": running[study.id],
                "fleet": fleet[study.id],
                "best_trial": _brief(best_row) if best_row else None,
            }
        )
    return out


def _cancelled_units(s: Session, studies: list[Study]) -> dict[int, int]:
    """Units cancelled trials had finished at their own rung (paused there when their study
    was cancelled, or stopped by its budget): their status says nothing of it; their trained
    resource does."""
    ids = [study.id for study in studies if study.status in store.FINISHED_STUDY]
    if not ids:
        return {}
    specs = {study.id: StoredSpec.of(study.spec) for study in studies if study.id in ids}
    stmt = (
        select(Trial.study_id, Trial.bracket, Trial.rung, Trial.resource_done, func.count())
        .where(Trial.study_id.in_(ids), Trial.status == TrialStatus.cancelled,
               Trial.resource_done > 0)
        .group_by(Trial.study_id, Trial.bracket, Trial.rung, Trial.resource_done)
    )  # fmt: skip
    out: dict[int, int] = defaultdict(int)
    for study_id, bracket, rung, trained, n in s.execute(stmt):
        at = rung_resource(specs[study_id], bracket, rung)
        if trained >= at or math.isclose(trained, at, rel_tol=1e-9):
            out[study_id] += n
    return out


def _fleet(s: Session, studies: list[Study]) -> dict[int, Row]:
    """Each study's priority, owner, fair share now, device-seconds and waiting time."""
    now = utcnow()
    ids = [study.id for study in studies]
    used = store.device_seconds(s, ids, now)
    spans = store.busy_intervals(s, ids, now)
    running = store.studies_with_status(s, (StudyStatus.running,))
    running_specs = {st.id: StoredSpec.of(st.spec) for st in running}
    shares = entitled_shares(
        StudyLoad(i, spec.priority, 0.0, owner=spec.owner) for i, spec in running_specs.items()
    )
    out: dict[int, Row] = {}
    for study in studies:
        spec = StoredSpec.of(study.spec)
        start = study.started_at or now
        end = store.run_end(study, now)
        # its packs' spans within its own run: a pack it shared trains on for the others
        # after it was cancelled, and that time is neither its work nor its wait
        busy = covered_seconds(
            ((max(a, start) - start).total_seconds(), (min(b, end) - start).total_seconds())
            for a, b in spans[study.id]
            if a < end and b > start
        )
        out[study.id] = {
            "priority": spec.priority,
            "owner": spec.owner,
            "share": round(shares[study.id], 4) if study.id in shares else None,
            "device_seconds": round(used[study.id], 3),
            "waiting_seconds": round(max(0.0, (store.run_seconds(study, now) or 0.0) - busy), 3),
        }
    return out


def _budget(study: Study, spec: StoredSpec, iterations: int, trials: int) -> Row:
    budget = spec.budget
    ran = store.run_seconds(study, utcnow())
    seconds = None if ran is None else round(ran, 3)
    return {
        "sampler": spec.sampler.name,
        "max_iterations": budget.max_iterations,
        "iterations": iterations,
        "max_trials": budget.max_trials,
        "trials": trials,
        "max_seconds": budget.max_seconds,
        "seconds": seconds,
        "target": budget.target,
        "stop_reason": study.stop_reason,
    }


def _brief(trial: Row) -> Row:
    return {"id": trial["id"], "config": trial["config"], "metrics": trial["metrics"]}
