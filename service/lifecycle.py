"""A study's life in the database: sample its trials, advance its brackets, finish it.

Every function here reads the current rows and writes the decision back, and
is idempotent: calling it twice, or after a crash half way, gives the same
database. Synchronous successive halving per bracket: a bracket's rung is
decided only when none of the bracket's trials is pending, queued or running.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

from packtune.errors import SpecError, StudyCannotRun
from packtune.hyperband import promote, rank
from packtune.rungs import rung_resource
from packtune.space import fusion_key, parse_space, sample_config
from packtune.spec import StoredSpec
from packtune.tuning import SAMPLE_CHUNK
from packtune.workloads import get_workload
from service import store
from service.models import (
    PackStatus,
    Study,
    StudyStatus,
    TrialStatus,
)

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

ACTIVE = (TrialStatus.pending, TrialStatus.queued, TrialStatus.running)
FINAL = (
    TrialStatus.completed,
    TrialStatus.stopped,
    TrialStatus.diverged,
    TrialStatus.failed,
    TrialStatus.cancelled,
)

# statuses that count as "finished the current rung" when deciding promotions
RUNG_DONE = (TrialStatus.paused, TrialStatus.diverged, TrialStatus.failed)


def start_study(s: Session, study: Study) -> tuple[int, bool]:
    """Sample the study's next :data:`SAMPLE_CHUNK` trials (deterministic from the seed, in
    sample-index order, bracket by bracket); once every trial of every bracket is there, mark
    the study running. Returns (trials inserted, whether sampling is complete)."""
    spec = StoredSpec.of(study.spec)
    try:
        workload = get_workload(study.workload)
        space = parse_space(spec.space)
        for name in space:  # a parameter the workload no longer takes
            workload.resolve({name: space[name].sample(random.Random(0))})
    except (KeyError, SpecError) as exc:
        raise StudyCannotRun(str(exc).strip("'\"")) from exc
    brackets = spec.brackets
    s_max = len(brackets) - 1
    slots = [s_max - j for j, rungs in enumerate(brackets) for _ in range(rungs[0].n)]
    have = sum(store.count_trials_by_status(s, study.id).values())
    rows, structural = [], workload.structural_params()
    for index in range(have, min(len(slots), have + SAMPLE_CHUNK)):
        config = sample_config(space, study.seed, index)
        resolved = workload.resolve(config)
        rows.append(
            {
                "sample_index": index,
                "bracket": slots[index],
                "rung": 0,
                "config": config,
                "fusion_key": fusion_key(workload.name, resolved, structural),
            }
        )
    inserted = store.add_trials(s, study.id, rows)
    complete = have + len(rows) >= len(slots)
    if complete:
        store.move_study(s, study, StudyStatus.running)
    return inserted, complete


def _measured_at(trial: store.TrialBrief, resource: float) -> bool:
    done = trial.measured_resource
    return done is not None and math.isclose(done, resource, rel_tol=1e-9, abs_tol=1e-9)


@dataclass
class Advance:
    promoted: int = 0
    stopped: int = 0
    completed: int = 0


def advance_brackets(s: Session, study: Study) -> Advance:
    """Decide every bracket whose current rung is finished.

    Only the brackets that can be decided are read, as :class:`~service.store.TrialBrief`
    rows (no configs), and written back with bulk UPDATEs.
    """
    spec = StoredSpec.of(study.spec)
    eta, metric, mode = int(spec.hyperband.eta), spec.objective.metric, spec.objective.mode
    out = Advance()
    for bracket, counts in store.brackets_summary(s, study.id).items():
        if any(counts[st] for st in ACTIVE) or not counts[TrialStatus.paused]:
            continue
        trials = store.trial_briefs(s, study.id, bracket=bracket)
        paused = [t for t in trials if t.status == TrialStatus.paused]
        rung = paused[0].rung
        if rung >= bracket:  # last rung of this bracket: done
            store.move_trials(s, [t.id for t in paused], TrialStatus.completed)
            out.completed += len(paused)
            continue
        contenders = [t for t in trials if t.rung == rung and t.status in RUNG_DONE]
        resource = rung_resource(spec, bracket, rung)
        # a paused trial's latest measurement is at its rung: its objective is on its row
        values = {t.id: t.objective for t in contenders if _measured_at(t, resource)}
        missing = [t.id for t in contenders if t.id not in values]
        if missing:  # rows written before the trials kept their objective
            values |= store.values_at(
                s, study.id, missing, resource, metric, bracket=bracket, rung=rung
            )
        for t in contenders:  # diverged and failed trials rank last
            if t.status != TrialStatus.paused:
                values[t.id] = None
        results = [(t.id, values[t.id]) for t in contenders]
        chosen = set(promote(results, eta, mode))
        store.record_promotions(
            s, study.id, bracket, rung, [(tid, values[tid]) for tid in sorted(chosen)]
        )
        promoted = [t.id for t in paused if t.id in chosen]
        stopped = [t.id for t in paused if t.id not in chosen]
        store.move_trials(s, promoted, TrialStatus.pending, rung=rung + 1)
        store.move_trials(s, stopped, TrialStatus.stopped)
        out.promoted += len(promoted)
        out.stopped += len(stopped)
    s.flush()
    return out


def best_trial(s: Session, study: Study) -> tuple[int, float] | None:
    """The best trial at max resource by the objective (finite values only)."""
    spec = StoredSpec.of(study.spec)
    max_resource = float(spec.hyperband.max_resource)
    metric, mode = spec.objective.metric, spec.objective.mode
    finals = store.trial_briefs(s, study.id, status=TrialStatus.completed)
    values = store.values_at(
        s, study.id, [t.id for t in finals], max_resource, metric, status=TrialStatus.completed
    )
    ranked = rank([(tid, v) for tid, v in values.items()], mode)
    for tid in ranked:
        v = values[tid]
        if v is not None and math.isfinite(v):
            return tid, v
    return None


def finish_if_done(s: Session, study: Study) -> bool:
    """Mark the study completed (with its best trial) or failed once no trial can move."""
    counts = store.count_trials_by_status(s, study.id)
    if not counts or any(counts.get(st, 0) for st in (*ACTIVE, TrialStatus.paused)):
        return False
    best = best_trial(s, study)
    if best is None:
        store.move_study(
            s,
            study,
            StudyStatus.failed,
            error="no trial reached max_resource with a finite objective value",
        )
    else:
        study.best_trial_id = best[0]
        store.move_study(s, study, StudyStatus.completed)
    return True


def cancel_rest(s: Session, study: Study) -> int:
    """For a cancelled (or failed) study: cancel every trial that can still move and every
    unstarted pack; returns the trials cancelled."""
    cancelled = store.move_study_trials(s, study.id, TrialStatus.cancelled)
    store.move_study_packs(
        s, study.id, PackStatus.cancelled, only_from=(PackStatus.pending, PackStatus.queued)
    )
    if study.finished_at is None:
        store.move_study(s, study, StudyStatus.cancelled)
    return cancelled
