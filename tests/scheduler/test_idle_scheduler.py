"""An idle scheduler leaves the cores to training, however slow its ticks are.

Issue: the loop waited ``scheduler_interval`` from a tick's start, so a tick that took
longer than the interval (15 small studies on a 2-core machine: 0.23 s against the 0.2 s the
pack-invariance test's servers tick at, and not far under the 0.5 s default) was followed by
the next at once, for as long as the studies ran: a whole core spent looking at a database
that had not changed, taken from the training it schedules.

And a tick that planned a pack was followed by another at once even when that pack took the
device's last slot: after each pack's end one tick planned the next pack, and the tick after
it found nothing to plan (~0.2 s each with 15 studies on 2 cores, beside a 0.3 s pack).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import accumulate

import pytest
from sqlalchemy.orm import Session, sessionmaker

from packtune.settings import Settings
from packtune.tuning import QUEUE_DEPTH
from service import store
from service.db import make_engine, session_factory, session_scope, upgrade
from service.models import PackStatus, StudyStatus
from service.rq_dispatcher import RQDispatcher
from service.scheduler import Scheduler, TickReport, idle_wait
from tests.support.fleet import idle_cpu_worker_for

Tick = tuple[float, float, TickReport]  # a tick's start and end (monotonic), its report

SPEC = {
    "name": "idle",
    "workload": "digits-mlp",
    "objective": {"metric": "val_loss", "mode": "min"},
    "space": {"lr": {"type": "loguniform", "low": 0.01, "high": 0.3}},
    "hyperband": {"max_resource": 27, "min_resource": 1, "eta": 3},
    "seed": 0,
}


@contextmanager
def looping(sched: Scheduler) -> Iterator[tuple[list[Tick], threading.Thread]]:
    """``sched.run`` in a thread, each tick's start, end and report recorded, until the
    block ends (then stopped and closed)."""
    ticks: list[Tick] = []
    tick = sched.tick

    def timed() -> TickReport:
        began = time.monotonic()
        report = tick()
        ticks.append((began, time.monotonic(), report))
        return report

    sched.tick = timed  # type: ignore[method-assign]
    stop = threading.Event()
    thread = threading.Thread(target=sched.run, kwargs={"stop": stop}, daemon=True)
    thread.start()
    try:
        yield ticks, thread
    finally:
        stop.set()
        thread.join(30)
        sched.close()


@pytest.fixture
def database(fresh_postgres: str) -> Iterator[tuple[str, sessionmaker[Session]]]:
    """A migrated database of this test's own: its URL and a session factory over it."""
    upgrade(fresh_postgres)
    engine = make_engine(fresh_postgres)
    try:
        yield fresh_postgres, session_factory(engine)
    finally:
        engine.dispose()


def test_idle_wait_keeps_a_third_of_the_time_at_most() -> None:
    assert idle_wait(0.5, 0.1, 5) == 0.4  # a quick tick: the rest of the interval
    assert idle_wait(0.5, 0.0, 5) == 0.5
    for tick in (0.2, 0.25, 1.0, 7.0):  # a slow one: twice its own length
        wait = idle_wait(0.2, tick, 100)
        assert tick / (tick + wait) <= 1 / 3 + 1e-9 and wait == 2 * tick


def test_idle_wait_renews_the_lease_before_it_lapses() -> None:
    """Waiting twice a 4 s tick would start the next 12 s after this one: past a 10 s lease,
    which a standby scheduler could then take. The next tick starts within ``renew_within``."""
    assert idle_wait(0.5, 4.0, renew_within=5) == 1.0
    assert idle_wait(0.5, 6.0, renew_within=5) == 0.0  # ticks back to back, as they must
    for tick in (0.1, 1.0, 2.0, 3.0, 4.9):
        assert tick + idle_wait(0.5, tick, renew_within=5) <= 5


def test_an_idle_scheduler_ticks_a_third_of_its_time_at_most(
    database: tuple[str, sessionmaker[Session]], redis_url: str
) -> None:
    """The real loop (``Scheduler.run``, PostgreSQL, an RQ queue no worker listens to) over
    12 running studies with nothing to train them, at an interval far shorter than its
    ticks: over four ticks and the waits after them, ticking fills under half of the time
    (a third, plus the loop's own); before, one tick followed another (~100%)."""
    url, factory = database
    with session_scope(factory) as s:
        ids = [
            store.create_study(s, name=f"idle-{i}", workload="digits-mlp", spec=SPEC, seed=i).id
            for i in range(12)
        ]
    settings = Settings(
        database_url=url,
        redis_url=redis_url,
        queue_name=f"idle-{uuid.uuid4().hex[:8]}",
        scheduler_interval=0.01,
    )
    sched = Scheduler(settings, factory, RQDispatcher(settings), holder="idle-test")
    with looping(sched) as (ticks, thread):
        deadline = time.monotonic() + 60
        while True:  # every study sampled and running: each tick now finds nothing to do
            with session_scope(factory) as s:
                if all(store.get_study(s, i).status == StudyStatus.running for i in ids):
                    break
            assert thread.is_alive() and time.monotonic() < deadline, "no study started"
            time.sleep(0.1)
        time.sleep(0.5)
        first = len(ticks)
        while len(ticks) < first + 5:  # five whole ticks, each with the wait after it
            assert thread.is_alive() and time.monotonic() < deadline + 60, "no ticks"
            time.sleep(0.05)
    cycles = ticks[first : first + 5]
    inside = sum(end - began for began, end, _ in cycles[:-1])
    share = inside / (cycles[-1][0] - cycles[0][0])
    assert share < 0.5, f"ticking {share:.0%} of the time"


def test_a_tick_that_fills_the_last_device_slot_is_followed_by_a_wait(
    database: tuple[str, sessionmaker[Session]], redis_url: str
) -> None:
    """The real loop over one unpacked study (a trial per pack) and one live CPU worker (an
    RQ queue it does not read, so no pack ends): a tick plans one pack per device, so while
    the device has a slot open and trials wait, the next tick follows at once; the tick
    that fills the last slot is followed by the interval's wait (before: by another tick at
    once, which found nothing)."""
    url, factory = database
    interval = 3.0
    with session_scope(factory) as s:
        spec = SPEC | {"packing": {"enabled": False}}
        store.create_study(s, name="busy", workload="digits-mlp", spec=spec, seed=0)
        idle_cpu_worker_for(s, "cpu-worker")  # digits-mlp measured already: no probe pack
    settings = Settings(
        database_url=url,
        redis_url=redis_url,
        queue_name=f"busy-{uuid.uuid4().hex[:8]}",
        scheduler_interval=interval,
        heartbeat_timeout=600,
    )
    sched = Scheduler(settings, factory, RQDispatcher(settings), holder="busy-test")
    with looping(sched) as (ticks, thread):
        deadline = time.monotonic() + 60
        while sum(t[2].planned for t in ticks) < QUEUE_DEPTH:
            assert thread.is_alive() and time.monotonic() < deadline, "no packs planned"
            time.sleep(0.02)
        made = accumulate(t[2].planned for t in ticks)  # packs planned by each tick's end
        filled = next(i for i, n in enumerate(made) if n >= QUEUE_DEPTH)
        time.sleep(max(0.0, ticks[filled][1] + interval / 2 - time.monotonic()))
    with session_scope(factory) as s:
        pending = store.packs_with_status(s, (PackStatus.pending, PackStatus.queued))
    planned = [t[2].planned for t in ticks[: filled + 1]]
    assert len(pending) == QUEUE_DEPTH, "a pack per device slot"
    assert planned[-QUEUE_DEPTH:] == [1] * QUEUE_DEPTH, planned  # one pack per tick
    # with a slot open and trials waiting, the next tick came at once, not an interval on
    gaps = [ticks[i + 1][0] - ticks[i][1] for i in range(filled)]
    assert gaps[-1] < interval / 3, gaps
    # the device full: the interval's wait, not a tick that cannot plan anything
    after = [began for began, _, _ in ticks[filled + 1 :]]
    assert not after or after[0] - ticks[filled][1] >= interval / 2, "ticked at once"
