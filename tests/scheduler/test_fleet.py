"""Many studies on one fleet, through the real scheduler and real training (in this process):
packs shared across studies change no study's results, and fair share serves a small study
submitted behind a large one."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import selectinload

from packtune.dispatcher import JobState
from packtune.settings import get_settings
from service import lifecycle, planning, queries, store
from service.db import get_sessionmaker, session_scope
from service.models import Pack, PackStatus, StudyStatus, TrialStatus, utcnow
from service.scheduler import Scheduler
from tests.scheduler.test_scheduler import (
    SPEC,
    SyncDispatcher,
    db,
    final_values,
    new_study,
    packs,
    run_to_end,
    scheduler,
)
from worker import execute, jobs
from worker.fused import FusedArray
from worker.jobs import PackWatch, run_pack

__all__ = ["db"]  # the fixture, used by name


#: a big study whose trials train their whole span in one unit (9 epochs, no rung cuts)
UNCUT: dict[str, Any] = {
    **SPEC, "sampler": "random", "seed": 3,
    "hyperband": {"max_resource": 9, "min_resource": 1, "eta": 3},
    "packing": {"enabled": True, "max_pack_size": None, "align_rungs": False},
}  # fmt: skip


def record_watches(monkeypatch: pytest.MonkeyPatch) -> list[PackWatch]:
    """The pack watches made from now on (a pack's watch reads requests to give way)."""
    watches: list[PackWatch] = []
    init = PackWatch.__init__

    def watched(self: PackWatch, *args: Any) -> None:
        watches.append(self)
        init(self, *args)

    monkeypatch.setattr(PackWatch, "__init__", watched)
    return watches


def all_packs() -> list[Pack]:
    with session_scope(get_sessionmaker()) as s:
        stmt = select(Pack).options(selectinload(Pack.members)).order_by(Pack.id)
        return list(s.scalars(stmt))


def trial_ids(study_id: int) -> set[int]:
    with session_scope(get_sessionmaker()) as s:
        return {t.id for t in store.trials_of(s, study_id)}


def test_a_study_beside_others_gives_what_it_gives_alone(db: None) -> None:
    """A study run alone, and the same study (same spec and seed) run beside others, give the
    same trial results, although the second time its trials share packs with them and fused
    arrays with those of the same data seed (and never with the other seed's), a study of
    another horizon among them: each member's cosine schedule runs to its own study's."""
    cosine = {"type": "choice", "values": ["cosine"]}  # its horizon: the study's R
    twin_spec = {**SPEC, "name": "alone", "seed": 5, "sampler": "random",
                 "space": {**SPEC["space"], "schedule": cosine}}  # fmt: skip
    alone = new_study(twin_spec)
    assert run_to_end(scheduler(SyncDispatcher()), alone) == StudyStatus.completed
    first_packs = {p.id for p in all_packs()}

    # same seed, R=9 against 3: its trials' schedules reach their floor three times later
    # (made first: its trials lead the arrays it shares with the twin's)
    other_horizon = new_study(
        {**twin_spec, "name": "other-horizon",
         "hyperband": {**twin_spec["hyperband"], "max_resource": 9}}
    )  # fmt: skip
    twin = new_study({**twin_spec, "name": "twin"})
    same_seed = new_study(
        {**twin_spec, "name": "same-seed",
         "space": {"lr": {"type": "loguniform", "low": 0.001, "high": 0.05}}}
    )  # fmt: skip
    other_seed = new_study({**twin_spec, "name": "other-seed", "seed": 6})
    # same seed, trained decoupled: shares packs, never an array with end-to-end trials
    decoupled = new_study({**twin_spec, "name": "decoupled",
                           "training": {"mode": "decoupled", "segments": 2}})  # fmt: skip
    sched = scheduler(SyncDispatcher())
    for study_id in (other_horizon, twin, same_seed, other_seed, decoupled):
        assert run_to_end(sched, study_id) == StudyStatus.completed

    where_alone, values_alone = final_values(alone)
    where_twin, values_twin = final_values(twin)
    assert where_twin == where_alone
    assert values_twin == pytest.approx(values_alone, rel=1e-5, abs=1e-6)

    studies = {i: trial_ids(i) for i in (twin, same_seed, other_seed, other_horizon, decoupled)}
    study_of = {t: i for i, ids in studies.items() for t in ids}
    shared = [p for p in all_packs() if p.id not in first_packs]
    held = [{study_of[m.trial_id] for m in p.members} for p in shared]
    assert any(len(h) >= 3 for h in held), held  # one pack, three studies or more
    fused = []
    for p in shared:
        for array in p.arrays or []:
            for stack in array["stacks"]:
                of = {study_of[t] for t in stack["trials"]}
                fused.append(of)
                assert other_seed not in of or of == {other_seed}, p.arrays  # its own lane
                assert decoupled not in of or of == {decoupled}, p.arrays
    assert any({twin, same_seed} <= of for of in fused), fused  # trained as one model
    assert any({twin, other_horizon} <= of for of in fused), fused
    # the API's packs of a study list its own units, and say who else was in the pack
    with session_scope(get_sessionmaker()) as s:
        rows, _ = queries.packs(s, twin, limit=500)
    assert {m["trial_id"] for r in rows for m in r["members"]} == studies[twin]
    assert any({same_seed, other_seed} <= set(r["shared_with"]) for r in rows)
    assert all(r["shared_trials"] == 0 for r in rows if not r["shared_with"])


def big_study(
    monkeypatch: pytest.MonkeyPatch, order: str, packing: dict[str, Any] | None = None
) -> tuple[int, SyncDispatcher, Scheduler, Callable[[Pack], None]]:
    """A big study (R=9) under dispatch ``order`` with a tiny fair-share quantum, a scheduler
    whose jobs wait to be run, and ``finish`` that runs one of them here."""
    monkeypatch.setenv("PACKTUNE_DISPATCH_ORDER", order)
    monkeypatch.setenv("PACKTUNE_FAIR_SHARE_QUANTUM", "0.000001")
    get_settings.cache_clear()
    big = new_study(
        {**SPEC, "name": "big", "sampler": "random", "packing": packing or {},
         "hyperband": {"max_resource": 9, "min_resource": 1, "eta": 3}}
    )  # fmt: skip
    dispatcher = SyncDispatcher(run=False)

    def finish(pack: Pack) -> None:
        assert run_pack(pack.id) == "completed"
        dispatcher.states[pack.job_id or ""] = (JobState.finished, None)

    return big, dispatcher, scheduler(dispatcher), finish


@pytest.mark.parametrize(("order", "served"), [("fair", "small"), ("id", "big")])
def test_a_small_study_behind_a_big_one_gets_the_next_free_slot(
    db: None, monkeypatch: pytest.MonkeyPatch, order: str, served: str
) -> None:
    """With fair share a small study submitted behind a big one that fills the device's
    queue takes the slot of the big one's waiting pack (given back before it started); in
    id order (packtune before fair share) it waits, and when a slot frees the big one, which
    still has ready trials, takes it again."""
    monkeypatch.setenv("PACKTUNE_SHARE_PACKS", "false")  # one study per pack: slots compete
    big, dispatcher, sched, finish = big_study(monkeypatch, order, {"max_pack_size": 2})
    sched.tick()
    (probe,) = all_packs()  # the first pack of a fusion key measures it; the rest waits
    finish(probe)
    sched.tick()
    sched.tick()
    queued = [p for p in all_packs() if p.status == PackStatus.queued]
    assert len(queued) == 2  # the device's queue is full (one running, one waiting)
    small = new_study(
        {**SPEC, "name": "small", "sampler": "random",
         "hyperband": {"max_resource": 1, "min_resource": 1, "eta": 3}}
    )  # fmt: skip
    sched.tick()
    if order == "fair":
        # the big study's waiting pack is given back; the small study takes its slot
        packs = {p.id: p for p in all_packs()}
        assert packs[queued[1].id].status == PackStatus.cancelled
        assert "withdrawn" in (packs[queued[1].id].error or "")
        assert packs[queued[0].id].status == PackStatus.queued  # not the one ahead
        (taken,) = [p for p in packs.values() if p.id > queued[1].id]
        assert taken.study_id == small
        with session_scope(get_sessionmaker()) as s:
            back = {t.status for t in store.trials_by_id(
                s, [m.trial_id for m in packs[queued[1].id].members])}  # fmt: skip
        assert back == {TrialStatus.pending}  # ready again, for the next slot
        return
    assert len(all_packs()) == 3  # no slot for it
    finish(queued[0])
    sched.tick()
    new = [p for p in all_packs() if p.id not in {probe.id} | {q.id for q in queued}]
    assert len(new) == 1
    assert {big: "big", small: "small"}[new[0].study_id] == served


@pytest.mark.parametrize("order", ["fair", "id"])
def test_a_device_busy_with_a_better_served_study_keeps_its_second_slot_for_it(
    db: None, monkeypatch: pytest.MonkeyPatch, order: str
) -> None:
    """While a small study's pack is in a device's hands, the big study (a worse fair-share
    band) does not queue a pack behind it: that pack would start the moment the small one's
    ends, a tick before the small study's next rung is planned, and be asked to give the
    device up again at every rung. Once the small study has nothing in hand, the big one
    gets the device. In id order (no fair share) the big study's trials are queued at once."""
    big, _, sched, finish = big_study(monkeypatch, order)

    def unfinished() -> list[Pack]:
        return [p for p in all_packs() if p.status in (PackStatus.pending, PackStatus.queued)]

    sched.tick()
    (probe,) = all_packs()  # the first pack of a fusion key measures it; the rest waits
    finish(probe)  # the big study has used device time: a worse band than a new study's
    small = new_study(
        {**SPEC, "name": "small", "sampler": "random",
         "hyperband": {"max_resource": 3, "min_resource": 1, "eta": 3}}
    )  # fmt: skip
    sched.tick()
    in_hand = unfinished()
    if order == "id":
        with session_scope(get_sessionmaker()) as s:  # its work is in the device's hands
            assert TrialStatus.queued in {t.status for t in store.trials_of(s, big)}
        return
    assert [p.study_id for p in in_hand] == [small]  # the second slot waits for it
    with session_scope(get_sessionmaker()) as s:
        statuses = {t.status for t in store.trials_of(s, big)}
    assert TrialStatus.pending in statuses  # ready, and held back
    assert not statuses & {TrialStatus.queued, TrialStatus.running}
    while (in_hand := unfinished()) and all(p.study_id == small for p in in_hand):
        for pack in in_hand:
            finish(pack)
        sched.tick()
    with session_scope(get_sessionmaker()) as s:
        assert store.get_study(s, small).status == StudyStatus.completed
    assert {p.study_id for p in in_hand} == {big}  # then the device is the big one's
    sched = scheduler(SyncDispatcher())  # the rest, run as it comes
    assert run_to_end(sched, big) == StudyStatus.completed


def test_a_pack_waiting_out_a_retry_holds_no_slot(
    db: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The small study's pack failed and waits out its backoff (up to a minute): it does not
    keep the big study off the device's other slot, which would idle through the wait."""
    big, _, sched, finish = big_study(monkeypatch, "fair")
    sched.tick()
    (probe,) = all_packs()
    finish(probe)
    small = new_study(
        {**SPEC, "name": "small", "sampler": "random",
         "hyperband": {"max_resource": 3, "min_resource": 1, "eta": 3}}
    )  # fmt: skip
    sched.tick()
    (waiting,) = [p for p in all_packs() if p.status == PackStatus.queued]
    assert waiting.study_id == small
    with session_scope(get_sessionmaker()) as s:
        pack = store.get_pack(s, waiting.id)
        assert store.retry_pack(s, pack, error="worker lost", fault=True, backoff=60)
        assert pack.retry_after is not None
    sched.tick()
    with session_scope(get_sessionmaker()) as s:
        assert TrialStatus.queued in {t.status for t in store.trials_of(s, big)}


@pytest.mark.parametrize(
    ("order", "epochs", "outcome"),
    [("fair", 1, "yielded"), ("fair", 0, "dropped"), ("id", 1, "completed")],
)
def test_a_running_pack_gives_its_device_up_to_a_study_with_a_better_fair_share(
    db: None, monkeypatch: pytest.MonkeyPatch, order: str, epochs: int, outcome: str
) -> None:
    """A small study submitted while a big one's pack trains: with fair share the running
    pack is asked to give its device up, stops inside an epoch, and its trials go on from
    there in later packs; asked before its first epoch's end (``epochs`` 0) while it may
    still drop what it trained (here: always), it drops it and its trials go on from where
    they were. Either way the big study's results equal its run
    alone. In id order the pack trains to its end."""
    monkeypatch.setattr(execute, "DROP_BELOW_S", 3600.0)  # a reported epoch still forbids it
    # the pack's watch looks when the scheduler nudges it, not on its own
    monkeypatch.setattr(jobs, "YIELD_CHECK_SECONDS", 3600.0)
    monkeypatch.setenv("PACKTUNE_DISPATCH_ORDER", order)
    monkeypatch.setenv("PACKTUNE_FAIR_SHARE_QUANTUM", "0.000001")
    get_settings.cache_clear()
    big_spec = {**UNCUT, "name": "alone"}
    alone = new_study(big_spec)
    assert run_to_end(scheduler(SyncDispatcher()), alone) == StudyStatus.completed
    before = {p.id for p in all_packs()}

    big = new_study({**big_spec, "name": "big"})
    dispatcher = SyncDispatcher(run=False)
    sched = scheduler(dispatcher)
    sched.tick()
    (first,) = [p for p in all_packs() if p.id not in before]
    assert max(m.to_resource for m in first.members) == 9  # a unit of 9 epochs, no cuts

    # the worker: the first array to reach step 3 of the epoch after `epochs` whole ones
    # blocks there until the test lets it go on, and then (fair share) until the pack's
    # watch has read the request
    reached, go_on = threading.Event(), threading.Event()
    step, watches = FusedArray.train_step, record_watches(monkeypatch)

    def gated(self: FusedArray, batch: Any) -> None:
        if self.step == epochs * self.steps_per_epoch + 3 and not reached.is_set():
            reached.set()
            assert go_on.wait(60)
            assert order != "fair" or watches[0].give_up.wait(60)
        step(self, batch)

    monkeypatch.setattr(FusedArray, "train_step", gated)
    result: list[str] = []
    worker = threading.Thread(target=lambda: result.append(run_pack(first.id)))
    worker.start()
    assert reached.wait(60)
    small = new_study({**SPEC, "name": "small", "sampler": "random", "seed": 4})
    sched.tick()
    go_on.set()
    worker.join(60)
    assert result == ["completed" if outcome == "completed" else "yielded"]
    assert dispatcher.nudged == (outcome != "completed")
    monkeypatch.setattr(FusedArray, "train_step", step)

    packs = {p.id: p for p in all_packs()}
    assert (packs[first.id].yield_requested_at is not None) == (outcome != "completed")
    if outcome != "completed":
        runs = packs[first.id].arrays or []
        assert any(r["gave_up"] for r in runs), runs
        notes = " ".join(n for r in runs for n in r["notes"])
        kept = [r for r in runs if r["gave_up"] and not r.get("dropped") and r["stacks"]]
        dropped = [t for r in runs if r.get("dropped") for t in r["trials"]]
        if outcome == "yielded":  # the array held had reported its first epoch: kept
            assert kept and "gave the device up after epoch" in notes, notes
        else:  # nothing kept: its trials are where they were, with no measurement yet
            assert dropped and "steps into its unit: that progress was dropped" in notes, notes
            with session_scope(get_sessionmaker()) as s:
                trials = [store.get_trial(s, t) for t in dropped]
                assert {(t.status, t.resource_done) for t in trials} == {(TrialStatus.pending, 0.0)}
                assert not any(store.measurements_of(s, t) for t in dropped)
        # the API says so too
        with session_scope(get_sessionmaker()) as s:
            rows, _ = queries.packs(s, big, limit=500)
        assert any(r["yielded"] for r in rows if r["id"] == first.id)

    sched = scheduler(SyncDispatcher())  # the rest, run as it comes
    for study_id in (small, big):
        assert run_to_end(sched, study_id) == StudyStatus.completed
    where_alone, values_alone = final_values(alone)
    where_big, values_big = final_values(big)
    assert where_big == where_alone
    assert values_big == pytest.approx(values_alone, rel=1e-5, abs=1e-6)


def test_the_scheduler_looks_again_when_a_running_pack_leaves_the_waiting_ones_band(
    db: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A small study's pack waits behind a big one's running pack of the same fair-share
    band (equal bands never preempt). The scheduler's loop does not wait for its next
    regular tick (30 s here) to look again: it wakes when the big study's device time
    crosses into the next band (a 1 s quantum here), and asks the pack to give way then.
    Before, the request waited for that tick (0.5 s by default: a small study behind a
    large one on a CPU lost most of it at its first rung)."""
    monkeypatch.setenv("PACKTUNE_SCHEDULER_INTERVAL", "30")
    monkeypatch.setenv("PACKTUNE_FAIR_SHARE_QUANTUM", "1.0")
    get_settings.cache_clear()
    big_spec = {**UNCUT, "name": "big"}
    warm = new_study({**big_spec, "name": "warm", "hyperband": SPEC["hyperband"]})
    assert run_to_end(scheduler(SyncDispatcher()), warm) == StudyStatus.completed  # probed
    before = {p.id for p in all_packs()}
    big = new_study(big_spec)
    dispatcher = SyncDispatcher(run=False)
    sched = scheduler(dispatcher)
    sched.tick()
    (first,) = [p for p in all_packs() if p.id not in before]
    assert first.study_id == big

    # the worker: the big study's array trains until asked to give way (20 s at most)
    step, watches = FusedArray.train_step, record_watches(monkeypatch)

    def gated(self: FusedArray, batch: Any) -> None:
        if self.step == 3:
            assert watches[0].give_up.wait(20)
        step(self, batch)

    monkeypatch.setattr(FusedArray, "train_step", gated)
    result: list[str] = []
    worker = threading.Thread(target=lambda: result.append(run_pack(first.id)))
    worker.start()
    while not watches:  # the pack is running
        time.sleep(0.01)
    new_study({**SPEC, "name": "small", "sampler": "random", "seed": 4})
    stop = threading.Event()
    loop = threading.Thread(target=sched.run, kwargs={"stop": stop})
    started = time.monotonic()
    loop.start()
    try:
        worker.join(20)
        waited = time.monotonic() - started
    finally:
        stop.set()
        sched.wake.set()
        loop.join(30)
    assert result == ["yielded"], result
    assert waited < 10, f"asked after {waited:.1f} s: at the next regular tick, not at once"
    (asked,) = [p for p in all_packs() if p.id == first.id]
    assert asked.yield_requested_at is not None


def failed_attempt(monkeypatch: pytest.MonkeyPatch, ran_for: float) -> tuple[int, Pack]:
    """A study whose first pack a worker took, trained ``ran_for`` seconds and failed; the
    scheduler's tick has seen it: pending again, not before a minute (the backoff)."""
    monkeypatch.setenv("PACKTUNE_RETRY_BACKOFF", "60")
    get_settings.cache_clear()
    study_id = new_study({**SPEC, "sampler": "random"})
    dispatcher = SyncDispatcher(run=False)  # jobs stay queued: this test plays the worker
    sched = scheduler(dispatcher)
    sched.tick()
    (pack, *_) = packs(study_id)
    with session_scope(get_sessionmaker()) as s:
        claimed = store.claim_pack(s, pack.id, worker_name="sync@test", device="cpu")
        assert claimed is not None
        claimed.started_at = utcnow() - timedelta(seconds=ran_for)
    dispatcher.states[pack.job_id or ""] = (JobState.failed, "RuntimeError: killed")
    sched.tick()
    return study_id, pack


def test_a_pack_waiting_for_its_retry_is_not_charged_device_time(
    db: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pack whose job failed after its worker took it goes back to pending and waits out
    its retry backoff; that wait is not device time. Before, the failed attempt's start stayed
    the pack's start, so every second of the wait was charged to its study as if the pack
    ran (its fair share shrank, and the dashboard showed it busy, not waiting)."""
    study_id, pack = failed_attempt(monkeypatch, ran_for=0.0)
    (retried, *_) = packs(study_id)
    assert retried.status == PackStatus.pending and retried.retry_after is not None
    later = utcnow() + timedelta(seconds=50)  # still waiting
    with session_scope(get_sessionmaker()) as s:
        assert store.device_seconds(s, [study_id], later)[study_id] < 5.0
        assert store.busy_intervals(s, [study_id], later)[study_id] == []


def test_a_failed_attempt_is_charged_to_its_study(
    db: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pack whose attempt held the device 20 s and then failed charges those 20 s to its
    study: while it waits for its retry, and once a second attempt has run too (20 s + that
    attempt's). Before, clearing the failed attempt's start dropped its time: a study whose
    packs kept failing used the device without its fair share shrinking (0 s charged)."""
    study_id, pack = failed_attempt(monkeypatch, ran_for=20.0)
    (retried, *_) = packs(study_id)
    assert retried.status == PackStatus.pending and retried.started_at is None
    later = utcnow() + timedelta(seconds=50)  # still waiting: the wait is not charged
    with session_scope(get_sessionmaker()) as s:
        charged = store.device_seconds(s, [study_id], later)[study_id]
    assert 20.0 <= charged < 25.0, charged
    with session_scope(get_sessionmaker()) as s:  # the second attempt runs 5 s and ends
        again = s.get(Pack, pack.id)
        assert again is not None
        again.status, again.finished_at = PackStatus.completed, utcnow()
        again.started_at = again.finished_at - timedelta(seconds=5)
    with session_scope(get_sessionmaker()) as s:
        charged = store.device_seconds(s, [study_id], utcnow())[study_id]
    assert 25.0 <= charged < 30.0, charged


@pytest.mark.parametrize("spill", ["false", "true"])
def test_trials_that_fit_only_a_busy_gpu_wait_for_it(
    db: None, monkeypatch: pytest.MonkeyPatch, spill: str
) -> None:
    """An 80 GiB GPU holds two packs of another study (no slot open); an 8 GiB one is free.
    The study's trials need 10 GiB + 1 GiB each: they wait for the large GPU. Before, the
    plan judged "fits no device" against the free devices only: without spilling every
    trial was failed for good ("exceeds every live device's free memory"), with it they
    trained spilled, shard by shard, through the small GPU."""
    monkeypatch.setenv("PACKTUNE_SPILL", spill)
    get_settings.cache_clear()
    gib = 2**30
    study_id = new_study({**SPEC, "name": "a", "sampler": "random"})
    other = new_study({**SPEC, "name": "b", "seed": 2, "sampler": "random"})
    with session_scope(get_sessionmaker()) as s:
        for sid in (study_id, other):
            lifecycle.sample_due(s, store.get_study(s, sid))
        for name, free in (("big", 80 * gib), ("small", 8 * gib)):
            gpu = {"index": 0, "name": "H100", "memory_total": free, "memory_available": free}
            store.heartbeat(s, name=name, host="h", device_kind="H100", gpus=[gpu])
        key = store.trial_briefs(s, study_id)[0].fusion_key
        store.set_memory_model(s, "digits-mlp", key, "H100", 10 * gib, gib)
        store.record_throughput(s, "digits-mlp", key, "H100", 1, 100.0)
        theirs = [t.id for t in store.trial_briefs(s, other)][:2]
        store.add_packs(s, [store.NewPack(other, [(i, key, 0.0, 1.0)], "big/cuda:0")
                            for i in theirs])  # fmt: skip
        store.move_trials(s, theirs, TrialStatus.queued)
    with session_scope(get_sessionmaker()) as s:
        workers = store.live_workers(s, 30)
        study = store.get_study(s, study_id)
        planning.plan_fleet(s, [study], workers, get_settings(), utcnow())
    with session_scope(get_sessionmaker()) as s:
        mine = store.trials_of(s, study_id)
        assert [t.error for t in mine if t.status == TrialStatus.failed] == []
        assert {t.status for t in mine} == {TrialStatus.pending}
    assert [p.device for p in packs(study_id)] == []


def test_a_pack_claimed_on_a_worker_of_gpu_1_counts_on_gpu_1(
    db: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``packtune worker --gpu 1`` heartbeats NVML GPU 1, so its packs are planned on
    ``w/cuda:1``; it trains on torch's cuda:0 (CUDA_VISIBLE_DEVICES=1). Its claim names
    the device as the planner does, so the running pack holds that device's slot (and can
    be asked to yield for it). Before, the claim wrote ``w/cuda:0``: on every GPU but the
    first, a running pack counted on no device the planner knows."""
    import torch

    from worker import jobs

    gib = 2**30
    study_id = new_study({**SPEC, "sampler": "random"})
    with session_scope(get_sessionmaker()) as s:
        lifecycle.sample_due(s, store.get_study(s, study_id))
        gpu = {"index": 1, "name": "H100", "memory_total": 80 * gib, "memory_available": 80 * gib}
        store.heartbeat(s, name="w", host="h", device_kind="H100", gpus=[gpu])
        workers = store.live_workers(s, 30)
        study = store.get_study(s, study_id)
        planning.plan_fleet(s, [study], workers, get_settings(), utcnow())
    (pack, *_) = packs(study_id)
    assert pack.device == "w/cuda:1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert jobs._load(pack.id, "w", torch.device("cuda:0"))
    (claimed, *_) = packs(study_id)
    assert (claimed.status, claimed.device) == (PackStatus.running, "w/cuda:1")
    with session_scope(get_sessionmaker()) as s:
        assert store.packs_per_device(s, (PackStatus.running,))["w/cuda:1"] == 1


@pytest.mark.parametrize("labelled", [True, False])
def test_an_owner_with_several_studies_is_served_as_one(
    db: None, monkeypatch: pytest.MonkeyPatch, labelled: bool
) -> None:
    """Alice's two studies have had 1.0 device-second each, Bob's one 1.5 (packs that ran,
    in the database). Labelled with their owners, Bob's ready pack is dispatched first (she
    has had 2.0 s to his 1.5) and her claim counts both of her studies even where only one
    is being planned; unlabelled, hers go first (each of her studies is less served)."""
    monkeypatch.setenv("PACKTUNE_FAIR_SHARE_QUANTUM", "0.25")
    get_settings.cache_clear()
    owners = {"a1": "alice", "a2": "alice", "b": "bob"}
    ids = {
        name: new_study({**SPEC, "name": name, "sampler": "random",
                         **({"owner": owner} if labelled else {})})
        for name, owner in owners.items()
    }  # fmt: skip
    now = utcnow()
    ready = {}
    with session_scope(get_sessionmaker()) as s:
        for name, study_id in ids.items():
            study = store.get_study(s, study_id)
            lifecycle.sample_due(s, study)
            first, second = store.trial_briefs(s, study_id, status=TrialStatus.pending)[:2]
            ran = store.create_pack(s, study_id=study_id, members=[(first.id, "k", 0.0, 1.0)])
            seconds = 1.5 if name == "b" else 1.0
            ran.status, ran.started_at = PackStatus.completed, now - timedelta(seconds=10)
            ran.finished_at = ran.started_at + timedelta(seconds=seconds)
            ready[name] = store.create_pack(
                s, study_id=study_id, members=[(second.id, "k", 0.0, 1.0)]
            ).id
    settings = get_settings()
    with session_scope(get_sessionmaker()) as s:
        pending = [s.get(Pack, pack_id) for pack_id in ready.values()]
        order = planning.dispatch_order(s, pending, settings, now)
        first_study = {v: k for k, v in ids.items()}[order[0].study_id]
        assert (first_study == "b") is labelled
        loads = planning.study_loads(s, [store.get_study(s, ids["a1"])], settings, now)
        # a tick's dispatch order and planning share the device-seconds read once
        memo: dict[int, float] = {}
        assert planning.dispatch_order(s, pending, settings, now, memo) == order
        assert set(memo) == set(ids.values())
        read: list[list[int]] = []
        real = store.device_seconds

        def device_seconds(s: Any, study_ids: Any, now: Any) -> dict[int, float]:
            read.append(list(study_ids))
            return real(s, study_ids, now)

        monkeypatch.setattr(store, "device_seconds", device_seconds)
        a1 = store.get_study(s, ids["a1"])
        assert planning.study_loads(s, [a1], settings, now, memo) == loads
        assert all(not study_ids for study_ids in read), read  # nothing read again
    if labelled:
        assert loads[ids["a1"]].owner_seconds == pytest.approx(2.0)  # a2's second counts
    else:
        assert loads[ids["a1"]].owner_seconds is None


@pytest.fixture(params=["sqlite", "postgresql"])
def either_db(request: pytest.FixtureRequest, db: None, embedded_db: pytest.MonkeyPatch) -> str:
    """The suite's in-process setup (``db``) on a SQLite file or on a PostgreSQL database
    of its own."""
    if request.param == "postgresql":
        from service.db import dispose_engines, upgrade

        url = request.getfixturevalue("fresh_postgres")
        embedded_db.setenv("PACKTUNE_DATABASE_URL", url)
        get_settings.cache_clear()
        dispose_engines()
        upgrade(url)
    return str(request.param)


def two_studies_sharing_packs() -> tuple[int, int]:
    """Two studies of the same seed run together to the end: they share packs."""
    spec = {**SPEC, "sampler": "random", "seed": 5}
    a, b = new_study({**spec, "name": "a"}), new_study({**spec, "name": "b"})
    # in id order: fair order alternates the studies by their device time so far, which
    # depends on how long each pack took (a loaded machine left some runs unshared)
    settings = get_settings().model_copy(update={"dispatch_order": "id"})
    sched = Scheduler(settings, get_sessionmaker(), SyncDispatcher(), holder="test")  # type: ignore[arg-type]
    for study_id in (a, b):
        assert run_to_end(sched, study_id) == StudyStatus.completed
    of = {t: i for i in (a, b) for t in trial_ids(i)}
    assert any({of[m.trial_id] for m in p.members} == {a, b} for p in all_packs())
    return a, b


def test_deleting_a_study_leaves_the_device_time_of_those_it_shared_packs_with(
    either_db: str,
) -> None:
    """Deleting a study takes its trials and their pack members with it; the packs it shared
    stay, and their time was split over the members left, so its share of them went to the
    other studies: their device-seconds (a running study's fair-share level) grew by time
    they never used (found by an audit: 6.5 s of a deleted study's moved onto two others).
    Its share so far now goes to nobody, and what the packs train after it is the others'."""
    a, b = two_studies_sharing_packs()
    ids = [p.id for p in all_packs()]
    with session_scope(get_sessionmaker()) as s:
        before = store.device_seconds(s, [a, b], utcnow())
        shares = store.study_shares(s, ids)
    with session_scope(get_sessionmaker()) as s:
        store.delete_study(s, b)
    with session_scope(get_sessionmaker()) as s:
        after = store.device_seconds(s, [a], utcnow())
        shares_after = store.study_shares(s, ids)
        summary = queries.study_summary(s, a)
    assert before[b] > 0
    assert after[a] == pytest.approx(before[a], rel=1e-9)
    shared = [i for i in ids if set(shares[i]) == {a, b}]
    assert shared
    # what a shared pack trains after the deletion is the studies' left in it, all of it
    # (an audit saw a charged 37.5 s of a 100 s attempt that only its trials trained)
    assert all(shares_after[i] == {a: 1.0} for i in shared)
    now = utcnow()
    with session_scope(get_sessionmaker()) as s:
        pack = s.get(Pack, shared[0])
        assert pack is not None and pack.started_at and pack.finished_at
        pack.spent_seconds += (pack.finished_at - pack.started_at).total_seconds()
        pack.started_at, pack.finished_at = now - timedelta(seconds=100), now
    with session_scope(get_sessionmaker()) as s:
        again = store.device_seconds(s, [a], now)
    assert again[a] == pytest.approx(before[a] + 100.0, rel=1e-9)
    assert summary["fleet"]["device_seconds"] == round(before[a], 3)


def test_a_cancelled_study_waited_for_what_it_waited_for_not_less(either_db: str) -> None:
    """A study's waiting time is its run less the time its packs ran, counted within its run
    only: a pack it shared trains on for the other studies after it is cancelled. Before,
    that later time was subtracted too (an audit saw 0.63 s reported against 1.47 s waited;
    down to 0 when the pack trained long enough)."""
    a, _ = two_studies_sharing_packs()
    with session_scope(get_sessionmaker()) as s:
        spans = store.busy_intervals(s, [a], utcnow())[a]
    last_start = spans[-1][0]
    (last,) = [p for p in packs(a) if p.started_at == last_start]
    # cancelled 1 s into its last pack, which then trains on for 60 s for the other study
    end = last_start + timedelta(seconds=1)
    with session_scope(get_sessionmaker()) as s:
        study = store.get_study(s, a)
        start, study.finished_at = study.started_at, end
        assert start is not None
        pack = s.get(Pack, last.id)
        assert pack is not None
        pack.finished_at = last_start + timedelta(seconds=61)
    busy = (
        sum((min(b, end) - max(a_, start)).total_seconds() for a_, b in spans[:-1] if a_ < end)
        + 1.0
    )  # the spans are disjoint: one pack at a time
    with session_scope(get_sessionmaker()) as s:
        waited = queries.study_summary(s, a)["fleet"]["waiting_seconds"]
    expected = (end - start).total_seconds() - busy
    assert expected > 0.01
    assert waited == pytest.approx(expected, abs=2e-3)


def test_a_pack_withdrawn_after_a_failed_attempt_keeps_that_attempt_s_error(
    db: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pack put back after a failed attempt, then withdrawn before its next start (its
    slot went to a better-served study), kept only the withdrawal's reason: the failure,
    which the study's packs show, was lost."""
    _, _, sched, _ = big_study(monkeypatch, "fair")
    sched.tick()
    waiting = next(p for p in all_packs() if p.status == PackStatus.queued)
    with session_scope(get_sessionmaker()) as s:
        pack = store.get_pack(s, waiting.id)
        assert store.retry_pack(s, pack, error="RuntimeError: worker lost", fault=True, backoff=0)
        assert store.move_pack(s, pack, PackStatus.queued, only_from=(PackStatus.pending,))
        planning._withdraw(s, pack)
    with session_scope(get_sessionmaker()) as s:
        pack = store.get_pack(s, waiting.id)
        assert pack.status == PackStatus.cancelled
        assert pack.error is not None and pack.error.startswith("withdrawn before it started")
        assert "RuntimeError: worker lost" in pack.error, pack.error
