"""A study's life in the database: sample its trials, advance its brackets, finish it.

Every function here reads the current rows and writes the decision back, and
is idempotent: calling it twice, or after a crash half way, gives the same
database. Synchronous successive halving per bracket: a bracket's rung is
decided only when none of the bracket's trials is pending, queued or running.
"""

from __future__ import annotations

import contextlib
import math
import random
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from packtune.asha import known_prefix, promotion_order
from packtune.checkpoints import checkpoint_path, study_folder
from packtune.errors import SpecError, StudyCannotRun, error_cause
from packtune.hyperband import promote, rank
from packtune.iterations import Slot, asha_slots, cutoff, first_rung, rungs_upto, slots
from packtune.rungs import rung_resource
from packtune.sampling import Observation, min_points, suggest
from packtune.settings import get_settings
from packtune.space import Dimension, fusion_key, parse_space
from packtune.spec import StoredSpec
from packtune.tuning import SAMPLE_CHUNK, WAVES_PER_BRACKET
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


def _space_of(study: Study, spec: StoredSpec) -> tuple[Any, dict[str, Dimension]]:
    try:
        workload = get_workload(study.workload)
        space = parse_space(spec.space)
        for name in space:  # a parameter the workload no longer takes
            workload.resolve({name: space[name].sample(random.Random(0))})
    except (KeyError, SpecError) as exc:
        raise StudyCannotRun(str(exc).strip("'\"")) from exc
    return workload, space


def sample_due(
    s: Session,
    study: Study,
    limit: int | None = None,
    sampled: int | None = None,
    *,
    whole: bool = True,
) -> tuple[int, bool]:
    """Sample every bracket whose turn has come (:mod:`packtune.iterations`: in order, each
    once the rungs it learns from are settled), ``limit`` trials a call at most (the
    scheduler gives a tick's studies :data:`~packtune.tuning.TICK_SAMPLES` together; by
    default one chunk's worth), but a whole chunk (:data:`SAMPLE_CHUNK` at most) even
    above it where ``whole`` (the tick has drawn nothing yet); the first trials mark the
    study running. Returns (trials inserted, whether some bracket within the budget is
    still to be sampled). ``sampled``: how many trials the study has, where the caller has
    just counted them (:attr:`Advance.sampled`)."""
    limit = SAMPLE_CHUNK if limit is None else limit
    spec = StoredSpec.of(study.spec)
    workload, space = _space_of(study, spec)
    done = sampled  # sampled so far
    if done is None:
        done = sum(store.count_trials_by_status(s, study.id).values())
    inserted = taken = 0  # trials new in the database; trials drawn (a retry finds some)
    more = False
    for slot in study_slots(spec):
        end = slot.first + slot.n
        if end <= done:
            continue
        if done == slot.first and slot.g > 0 and not _due(s, study, spec, slot):
            more = True
            break
        size = wave_size(spec, space, slot)
        while done < end:
            # chunks cut at fixed offsets from the bracket's start (a model draws a chunk
            # as one batch: the same draws whatever the ticks), each whole in one tick;
            # a model's chunk after the first waits for the first rung of those before it
            offset = (done - slot.first) // size + 1
            stop = min(end, slot.first + offset * size)
            if taken + stop - done > limit and (taken or not whole):
                break
            waits = spec.sampler.name == "tpe" and done > slot.first
            if waits and not _wave_settled(s, study, slot, done):
                break
            inserted += _sample(s, study, spec, workload, space, slot, range(done, stop))
            taken += stop - done
            done = stop
        if done < end:
            more = True
            break
    if inserted and study.status == StudyStatus.pending:
        store.move_study(s, study, StudyStatus.running)
    return inserted, more


def wave_size(spec: StoredSpec, space: dict[str, Dimension], slot: Slot) -> int:
    """Trials of ``slot`` drawn together. With a model, a bracket whose first rung is the
    study's lowest resource is drawn in :data:`WAVES_PER_BRACKET` waves (at least what a
    model needs each), so that its later draws learn from its earlier ones' first rung as a
    sequential sampler learns from every trial, at one cheap rung of waiting per wave; any
    other bracket at once, so that its long chain of rungs starts early. Without a model,
    all at once."""
    if spec.sampler.name != "tpe" or first_rung(spec.brackets, slot.s) > _lowest(spec):
        return SAMPLE_CHUNK
    return min(SAMPLE_CHUNK, max(min_points(space), -(-slot.n // WAVES_PER_BRACKET)))


def _lowest(spec: StoredSpec) -> float:
    """The study's lowest rung resource."""
    return min(float(r.resource) for b in spec.brackets for r in b)


def _wave_settled(s: Session, study: Study, slot: Slot, upto: int) -> bool:
    """The trials of ``slot`` before sample index ``upto`` have all been measured at its
    first rung (or diverged or failed there)."""
    return not store.count_trials(
        s, study.id, iteration=slot.iteration, bracket=slot.s, rung=0, status=ACTIVE,
        index_from=slot.first, index_to=upto,
    )  # fmt: skip


def study_slots(spec: StoredSpec) -> Iterator[Slot]:
    """The study's brackets (Hyperband) or batches (ASHA), in sampling order."""
    iterations, max_trials = spec.budget.iterations(), spec.budget.max_trials
    if spec.scheduler == "asha":
        return asha_slots(spec.brackets, iterations, max_trials)
    return slots(spec.brackets, iterations, max_trials)


def _due(s: Session, study: Study, spec: StoredSpec, slot: Slot) -> bool:
    """Whether bracket ``slot`` (not the study's first) may be sampled now: an iteration's
    first bracket once every trial of the previous iteration has started training (so that
    sampling never runs ahead of training, whose cheap units would otherwise take every
    pack); with a model, once the rungs it learns from are settled too."""
    progress = store.rung_counts(s, study.id)
    if slot.s == len(spec.brackets) - 1 and any(
        counts[(0, st)]
        for (iteration, _), counts in progress.items()
        if iteration == slot.iteration - 1
        for st in (TrialStatus.pending, TrialStatus.queued)
    ):
        return False
    if spec.sampler.name == "random":
        return True  # an iteration's brackets start together
    return all(
        _settled(counts, top)
        for (iteration, bracket), counts in progress.items()
        if (top := _top_rung(spec, iteration, bracket, slot)) is not None
    )


def _top_rung(spec: StoredSpec, iteration: int, bracket: int, slot: Slot) -> int | None:
    """The highest rung of bracket ``(iteration, bracket)`` that ``slot`` learns from, or
    None (not an earlier bracket, or none of its rungs is low enough)."""
    if (iteration, -bracket) >= (slot.iteration, -slot.s):
        return None
    rungs = rungs_upto(spec.brackets, bracket, cutoff(spec.brackets, _previous_s(spec, slot)))
    return rungs[-1] if rungs else None


def _settled(counts: Counter[tuple[int, TrialStatus]], top: int) -> bool:
    """Rungs 0..``top`` of a bracket are measured and will not change: no trial at or below
    ``top`` is still to train, and none below it waits for its rung's decision."""
    for (rung, status), n in counts.items():
        if not n:
            continue
        if status in ACTIVE and rung <= top:
            return False
        if status == TrialStatus.paused and rung < top:
            return False
    return True


def _sample(
    s: Session,
    study: Study,
    spec: StoredSpec,
    workload: Any,
    space: dict[str, Dimension],
    slot: Slot,
    indices: range,
) -> int:
    observations = []
    if spec.sampler.name == "tpe":
        if slot.g:
            observations = _observations(s, study, spec, slot)
        observations += _own_observations(s, study, spec, slot, indices.start)
    configs = suggest(
        space, observations, seed=study.seed, indices=list(indices),
        mode=spec.objective.mode, sampler=spec.sampler.name,
        random_fraction=spec.sampler.random_fraction,
    )  # fmt: skip
    structural = workload.structural_params()
    rows = [
        {
            "sample_index": index,
            "iteration": slot.iteration,
            "bracket": slot.s,
            "rung": 0,
            "config": config,
            "fusion_key": fusion_key(workload.name, workload.resolve(config), structural),
        }
        for index, config in zip(indices, configs, strict=True)
    ]
    return store.add_trials(s, study.id, rows)


def _observations(s: Session, study: Study, spec: StoredSpec, slot: Slot) -> list[Observation]:
    """The results bracket ``slot`` learns from: every earlier bracket's settled rungs up
    to the cutoff, in a fixed order (diverged trials as ``None``; failed ones left out)."""
    limit = cutoff(spec.brackets, _previous_s(spec, slot))
    metric = spec.objective.metric
    out: list[Observation] = []
    trials = [
        t for t in store.trials_of(s, study.id)
        if (t.iteration, -t.bracket) < (slot.iteration, -slot.s)
    ]  # fmt: skip
    by_resource: dict[float, list[Any]] = {}
    for t in trials:
        for rung in rungs_upto(spec.brackets, t.bracket, limit):
            if t.rung >= rung and not (t.rung == rung and t.status == TrialStatus.failed):
                by_resource.setdefault(rung_resource(spec, t.bracket, rung), []).append((t, rung))
    for resource in sorted(by_resource):
        members = by_resource[resource]
        values = store.values_at(s, study.id, [t.id for t, _ in members], resource, metric)
        for t, rung in sorted(members, key=lambda m: m[0].sample_index):
            value = values.get(t.id)
            if value is None and not (t.rung == rung and t.status == TrialStatus.diverged):
                continue  # not measured there (a trial failed before it): nothing to learn
            out.append(Observation(config=dict(t.config), resource=resource, value=value))
    return out


def _own_observations(
    s: Session, study: Study, spec: StoredSpec, slot: Slot, upto: int
) -> list[Observation]:
    """The first-rung results of ``slot``'s trials drawn before sample index ``upto``."""
    if upto <= slot.first:
        return []
    resource = rung_resource(spec, slot.s, 0)
    trials = [
        t for t in store.trials_of(s, study.id, iteration=slot.iteration, bracket=slot.s)
        if slot.first <= t.sample_index < upto
    ]  # fmt: skip
    values = store.values_at(s, study.id, [t.id for t in trials], resource,
                             spec.objective.metric)  # fmt: skip
    out = []
    for t in sorted(trials, key=lambda t: t.sample_index):
        value = values.get(t.id)
        if value is None and t.status != TrialStatus.diverged:
            continue
        out.append(Observation(config=dict(t.config), resource=resource, value=value))
    return out


def _previous_s(spec: StoredSpec, slot: Slot) -> int:
    """The ``s`` of the bracket sampled just before ``slot`` (ASHA: every batch is s_max)."""
    s_max = len(spec.brackets) - 1
    if spec.scheduler == "asha":
        return s_max
    return 0 if slot.s == s_max else slot.s + 1


def _measured_at(trial: store.TrialBrief, resource: float) -> bool:
    done = trial.measured_resource
    return done is not None and math.isclose(done, resource, rel_tol=1e-9, abs_tol=1e-9)


@dataclass
class Advance:
    promoted: int = 0
    stopped: int = 0
    completed: int = 0
    #: the trials the study has (decisions move trials, never add or remove one); None
    #: where the decisions did not count them
    sampled: int | None = None
    #: the study's trials per status where no decision moved one (else None): what
    #: :func:`finish_if_done` would count again
    statuses: Counter[TrialStatus] | None = None


def advance_brackets(s: Session, study: Study) -> Advance:
    """Decide every bracket whose current rung is finished.

    Only the brackets that can be decided are read, in one query, as
    :class:`~service.store.TrialBrief` rows (no configs); the decisions of all of them are
    written back together: one INSERT of the promotions, one bulk UPDATE per kind of move
    (brackets hold disjoint trials, so no decision reads another's writes).
    """
    spec = StoredSpec.of(study.spec)
    if spec.scheduler == "asha":
        return advance_asha(s, study, spec)
    eta, metric, mode = int(spec.hyperband.eta), spec.objective.metric, spec.objective.mode
    out = Advance()
    sizes = {
        len(spec.brackets) - 1 - j: [r.n for r in rungs] for j, rungs in enumerate(spec.brackets)
    }
    planned = {bracket: rungs[0] for bracket, rungs in sizes.items()}
    summary = store.brackets_summary(s, study.id)
    out.sampled = sum(sum(counts.values()) for counts in summary.values())
    due = [
        key
        for key, counts in summary.items()
        if not any(counts[st] for st in ACTIVE)
        and counts[TrialStatus.paused]
        # drawn in waves: a bracket not wholly sampled yet is not decided
        and sum(counts.values()) >= planned[key[1]]
    ]
    if not due:
        out.statuses = Counter(dict.fromkeys(TrialStatus, 0))  # as count_trials_by_status
        for counts in summary.values():
            out.statuses.update(counts)
        return out
    briefs = store.bracket_briefs(s, study.id, due)
    completed: list[int] = []
    stopped: list[int] = []
    promoted: dict[int, list[int]] = {}  # rung promoted to: trial ids
    records: list[store.Promotion] = []
    for iteration, bracket in due:
        trials = briefs[iteration, bracket]
        paused = [t for t in trials if t.status == TrialStatus.paused]
        rung = paused[0].rung
        if rung >= bracket:  # last rung of this bracket: done
            completed += [t.id for t in paused]
            continue
        contenders = [t for t in trials if t.rung == rung and t.status in RUNG_DONE]
        resource = rung_resource(spec, bracket, rung)
        # a paused trial's latest measurement is at its rung: its objective is on its row
        values = {t.id: t.objective for t in contenders if _measured_at(t, resource)}
        missing = [t.id for t in contenders if t.id not in values]
        if missing:  # rows written before the trials kept their objective
            values |= store.values_at(
                s, study.id, missing, resource, metric,
                iteration=iteration, bracket=bracket, rung=rung,
            )  # fmt: skip
        for t in contenders:  # diverged and failed trials rank last
            if t.status != TrialStatus.paused:
                values[t.id] = None
        results = [(t.id, values[t.id]) for t in contenders]
        chosen = set(promote(results, eta, mode, planned=sizes[bracket][rung]))
        records += [
            store.Promotion(tid, values[tid], iteration, bracket, rung) for tid in sorted(chosen)
        ]
        promoted.setdefault(rung + 1, []).extend(t.id for t in paused if t.id in chosen)
        stopped += [t.id for t in paused if t.id not in chosen]
    store.record_promotions_of(s, study.id, records)
    for to_rung, ids in sorted(promoted.items()):
        store.move_trials(s, ids, TrialStatus.pending, rung=to_rung)
        out.promoted += len(ids)
    store.move_trials(s, stopped, TrialStatus.stopped)
    store.move_trials(s, completed, TrialStatus.completed)
    out.stopped, out.completed = len(stopped), len(completed)
    s.flush()
    return out


def advance_asha(s: Session, study: Study, spec: StoredSpec) -> Advance:
    """ASHA's decisions (:func:`packtune.asha.promotions`): every rung's known prefix of
    results, rung 0's in sample-index order and a higher rung's in the order its trials
    were promoted (:func:`packtune.asha.promotion_order`), promotes its best
    ``floor(m / eta)`` as they come;
    the top rung's trials complete. Once nothing trains and nothing more will be sampled,
    the trials still waiting at a lower rung are stopped."""
    eta, metric, mode = int(spec.hyperband.eta), spec.objective.metric, spec.objective.mode
    s_max = len(spec.brackets) - 1
    top = s_max  # the ladder of bracket s_max has rungs 0..s_max
    out = Advance()
    briefs = sorted(store.trial_briefs(s, study.id), key=lambda t: t.sample_index)
    paused_top = [t.id for t in briefs if t.status == TrialStatus.paused and t.rung >= top]
    store.move_trials(s, paused_top, TrialStatus.completed)
    out.completed += len(paused_top)
    by_id = {t.id: t for t in briefs}
    # rung 0's trials in sample-index order; rung k + 1's in the order they were promoted
    # out of rung k (packtune.asha.promotion_order), which a later promotion only extends
    reached = [t for t in briefs if t.status != TrialStatus.cancelled]
    waits = [t.rung for t in briefs if t.status == TrialStatus.paused and t.rung < top]
    for rung in range(max(waits, default=-1) + 1):  # the rungs above decide nothing now
        resource = rung_resource(spec, s_max, rung)
        above = [t.id for t in reached if t.rung > rung]
        values = store.values_at(s, study.id, above, resource, metric) if above else {}
        results = []
        for t in reached:
            if t.rung > rung:
                results.append((t.id, values.get(t.id), True))
            elif t.status in (TrialStatus.paused, TrialStatus.stopped, TrialStatus.completed):
                value = t.objective if _measured_at(t, resource) else None
                if value is None and not _measured_at(t, resource):
                    value = store.values_at(s, study.id, [t.id], resource, metric)[t.id]
                results.append((t.id, value, True))
            elif t.status in (TrialStatus.diverged, TrialStatus.failed):
                results.append((t.id, None, True))
            else:  # still training toward this rung: the decisions after it wait
                results.append((t.id, None, False))
        ranked = promotion_order(known_prefix(results), eta, mode)
        chosen = set(ranked)
        waiting = [t for t in reached if t.rung == rung and t.status == TrialStatus.paused]
        moving = [t for t in waiting if t.id in chosen]
        promoted = [t.id for t in moving]
        if promoted:
            value_of = {tid: v for tid, v, _ in results}
            # one ladder for every iteration's trials; each promotion names its trial's own
            records = [store.Promotion(t.id, value_of[t.id], t.iteration, s_max, rung)
                       for t in moving]  # fmt: skip
            store.record_promotions_of(s, study.id, records)
            store.move_trials(s, promoted, TrialStatus.pending, rung=rung + 1)
            out.promoted += len(promoted)
            for tid in promoted:  # as the next rung reads them: on their way to it
                by_id[tid] = by_id[tid]._replace(status=TrialStatus.pending, rung=rung + 1)
        # a trial above this rung that the order misses (promoted under an older reading,
        # in sample-index order) comes after it
        reached = [by_id[i] for i in ranked if by_id[i].status != TrialStatus.cancelled] + [
            t for t in reached if t.rung > rung and t.id not in chosen
        ]
    if out.promoted == 0 and not _more_to_come(s, study, spec, briefs):
        rest = [t.id for t in briefs if t.status == TrialStatus.paused and t.rung < top]
        store.move_trials(s, rest, TrialStatus.stopped)
        out.stopped += len(rest)
    s.flush()
    return out


def _more_to_come(s: Session, study: Study, spec: StoredSpec, briefs: list[Any]) -> bool:
    """Some trial is still training, or more trials will be sampled."""
    if any(t.status in ACTIVE for t in briefs):
        return True
    return sum(slot.n for slot in study_slots(spec)) > len(briefs)


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


def finish_if_done(
    s: Session, study: Study, more: bool = False, counts: Mapping[TrialStatus, int] | None = None
) -> bool:
    """Mark the study completed (with its best trial) or failed once no trial can move and
    no bracket is still to be sampled (``more``). ``counts``: its trials per status, read
    earlier in this transaction (:attr:`Advance.statuses`); counted here if None. Read
    earlier, they can only be behind in the direction of not done yet: workers move trials
    on to finished states, never back."""
    if counts is None:
        counts = store.count_trials_by_status(s, study.id)
    if more or not counts or any(counts.get(st, 0) for st in (*ACTIVE, TrialStatus.paused)):
        return False
    _complete(s, study)
    return True


def prune_checkpoints(s: Session, study: Study) -> list[int]:
    """At a study's end: delete the checkpoints of its stopped trials but for the best
    ``PACKTUNE_KEEP_CHECKPOINTS`` (furthest trained, then by the objective), which never
    train again; completed and failed trials (a failed study may be retried) keep theirs.
    Returns the trials whose checkpoints went."""
    settings = get_settings()
    mode = StoredSpec.of(study.spec).objective.mode
    # rows, not ORM objects with their configs: a study's end may stop thousands
    stopped = store.trial_briefs(s, study.id, status=TrialStatus.stopped, checkpointed=True)

    def order(t: store.TrialBrief) -> tuple[float, int, float, int]:
        value = t.objective
        finite = value is not None and math.isfinite(value)
        score = (value if mode == "min" else -value) if finite and value is not None else 0.0
        return (-(t.measured_resource or 0.0), 0 if finite else 1, score, t.id)

    gone = sorted(stopped, key=order)[settings.keep_checkpoints :]
    for t in gone:
        with contextlib.suppress(OSError):  # shared storage unmounted here: kept, not fatal
            checkpoint_path(settings.checkpoint_dir, study.id, t.id).unlink()
    # segment units' parts of a span a unit died before clearing (its trial's checkpoint
    # has them): no unit reads them once the study has ended
    with contextlib.suppress(OSError):
        for part in study_folder(settings.checkpoint_dir, study.id).glob("trial-*.segment*.pt"):
            part.unlink(missing_ok=True)
    store.forget_checkpoints(s, [t.id for t in gone])
    return [t.id for t in gone]


def root_cause(s: Session, study: Study) -> str:
    """Why no trial got through, for a failed study's error: how many trials failed or
    diverged, and the most frequent error (``: 13 of 13 trials failed (ValueError: ...)``)."""
    counts = store.count_trials_by_status(s, study.id)
    total = sum(counts.values())
    failed, diverged = counts.get(TrialStatus.failed, 0), counts.get(TrialStatus.diverged, 0)
    parts = []
    if failed:
        errors = Counter(
            error_cause(t.error or "")
            for t in store.trials_of(s, study.id, status=TrialStatus.failed)
        )
        text, n = errors.most_common(1)[0]
        parts.append(f"{failed} of {total} trials failed ({n} with {text})")
    if diverged:
        parts.append(f"{diverged} of {total} diverged (their loss became non-finite)")
    return f": {'; '.join(parts)}" if parts else ""


def _complete(s: Session, study: Study, reason: str | None = None) -> None:
    prune_checkpoints(s, study)
    best = best_trial(s, study)
    if best is None:
        error = "no trial reached max_resource with a finite objective value"
        if reason is not None:
            error = f"the budget ({reason}) ran out before any trial reached max_resource"
        error += root_cause(s, study)
        store.move_study(s, study, StudyStatus.failed, error=error, stop_reason=reason)
    else:
        study.best_trial_id = best[0]
        store.move_study(s, study, StudyStatus.completed, stop_reason=reason)


def budget_spent(s: Session, study: Study, now: datetime) -> str | None:
    """The budget that ends the study now, if any: ``max_seconds`` of running time
    (:func:`service.store.run_seconds`), or
    ``target`` reached by a trial at ``max_resource`` (``max_iterations`` and
    ``max_trials`` end it by sampling no more)."""
    budget = StoredSpec.of(study.spec).budget
    if budget.max_seconds is not None:
        ran = store.run_seconds(study, now)
        if ran is not None and ran >= budget.max_seconds:
            return "max_seconds"
    if budget.target is not None:
        mode = StoredSpec.of(study.spec).objective.mode
        values = [t.objective for t in _trained_to_max(s, study) if t.objective is not None]
        if any(v <= budget.target if mode == "min" else v >= budget.target for v in values):
            return "target"
    return None


def _trained_to_max(s: Session, study: Study) -> list[store.TrialBrief]:
    """Trials measured at ``max_resource`` with a finite objective: completed, or paused
    there (a Hyperband trial at R waits for the rest of its bracket's last rung)."""
    max_resource = float(StoredSpec.of(study.spec).hyperband.max_resource)
    return [
        t
        for status in (TrialStatus.paused, TrialStatus.completed)
        for t in store.trial_briefs(s, study.id, status=status)
        if t.measured_resource is not None
        and math.isclose(t.measured_resource, max_resource, rel_tol=1e-9)
        and t.objective is not None
        and math.isfinite(t.objective)
    ]


def stop_for_budget(s: Session, study: Study, reason: str) -> None:
    """End a study whose budget is spent: trials already trained to ``max_resource`` (paused
    there for their bracket) are completed, what can still move is cancelled (running packs
    stop at their next step), and the study completes with its best trial so far."""
    done = [t.id for t in _trained_to_max(s, study) if t.status == TrialStatus.paused]
    store.move_trials(s, done, TrialStatus.completed, only_from=(TrialStatus.paused,))
    store.move_study_trials(s, study.id, TrialStatus.cancelled)
    store.move_study_packs(
        s, study.id, PackStatus.cancelled, only_from=(PackStatus.pending, PackStatus.queued)
    )
    _complete(s, study, reason)


def cancel_rest(s: Session, study: Study) -> int:
    """For a cancelled (or failed) study: cancel every trial that can still move and every
    unstarted pack; returns the trials cancelled."""
    cancelled = store.move_study_trials(s, study.id, TrialStatus.cancelled)
    store.move_study_packs(
        s, study.id, PackStatus.cancelled, only_from=(PackStatus.pending, PackStatus.queued)
    )
    if study.finished_at is None:
        store.move_study(s, study, StudyStatus.cancelled)
    prune_checkpoints(s, study)
    return cancelled
