"""Prometheus metrics, computed from the database at scrape time.

The API keeps no counters in memory: every value below is read from the
database when ``/metrics`` is scraped, so any number of API replicas report
the same numbers and a restart loses nothing. :class:`DatabaseCollector` is a
``prometheus_client`` custom collector; each scrape costs a fixed number of
queries, whatever the number of studies, trials or packs.

Families (all prefixed ``packtune_``):

- ``database_up`` -- 1 when the database answered this scrape (0 and nothing else if not);
- ``studies``, ``trials``, ``packs`` {status} -- rows now in each status (zeros included);
- ``packs_dispatched_total`` -- pack attempts handed to a queue, retries included;
- ``packs_finished_total`` {status} -- packs completed, failed, split or cancelled;
- ``pack_duration_seconds`` -- histogram, claim to finish, of packs that ran;
- ``trial_steps_per_second`` {workload, device_kind, k} -- the profiles' smoothed
  throughput of fused arrays of size k (median over fusion keys: a key is an architecture's
  JSON, unbounded as a label);
- ``memory_model_bytes`` {workload, device_kind, part} -- base and per_trial, the largest
  over fusion keys; ``fusion_keys`` {workload, device_kind} -- how many were measured;
- ``worker_alive`` {worker, host, device_kind};
- ``worker_gpu_memory_{used,free,total}_bytes``, ``worker_gpu_utilization_ratio``
  {worker, gpu, name} -- the latest NVML heartbeat of live workers (``gpu`` is the NVML index).

The ``*_total`` counters are counts of rows, so deleting a study lowers them;
Prometheus reads that as a counter reset, which ``rate()`` handles. GPU
readings are exported only for live workers (a dead worker's last reading
is stale).
"""

from __future__ import annotations

import logging
import statistics
from collections import defaultdict
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from sqlalchemy import ColumnElement, Float, and_, case, cast, func, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from packtune.errors import PacktuneError
from service.db import session_scope
from service.models import (
    Pack,
    PackStatus,
    Profile,
    Study,
    StudyStatus,
    Trial,
    TrialStatus,
    Worker,
    WorkerStatus,
)
from service.store import FINISHED_PACK

log = logging.getLogger(__name__)

PREFIX = "packtune"
DURATION_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
"""Upper bounds (seconds) of the pack duration histogram; ``+Inf`` is added."""


def _name(suffix: str) -> str:
    return f"{PREFIX}_{suffix}"


class DatabaseCollector(Collector):
    """Yield every ``packtune_*`` family from one database session per scrape."""

    def __init__(self, factory: sessionmaker[Session], heartbeat_timeout: float) -> None:
        self.factory = factory
        self.heartbeat_timeout = heartbeat_timeout

    def collect(self) -> Iterable[Metric]:
        up = GaugeMetricFamily(_name("database_up"), "1 when the database answered this scrape.")
        try:
            with session_scope(self.factory) as s:
                families = list(self._families(s))
        except (SQLAlchemyError, PacktuneError) as exc:
            log.warning("metrics scrape: database unavailable: %s", exc)
            up.add_metric([], 0)
            return [up]
        up.add_metric([], 1)
        return [up, *families]

    def _families(self, s: Session) -> Iterator[Metric]:
        yield _by_status(s, Study.status, StudyStatus, "studies", "Studies by status.")
        yield _by_status(s, Trial.status, TrialStatus, "trials", "Trials by status.")
        yield _by_status(s, Pack.status, PackStatus, "packs", "Packs now in each status.")
        yield from _pack_counters(s)
        yield _pack_durations(s)
        yield from _profiles(s)
        yield from _workers(s, self.heartbeat_timeout)


def _by_status(
    s: Session, column: Any, statuses: Iterable[Any], suffix: str, doc: str
) -> GaugeMetricFamily:
    counts = dict.fromkeys((status.value for status in statuses), 0)
    for status, n in s.execute(select(column, func.count()).group_by(column)):
        counts[status.value] = n
    family = GaugeMetricFamily(_name(suffix), doc, labels=["status"])
    for status, n in counts.items():
        family.add_metric([status], n)
    return family


def _pack_counters(s: Session) -> Iterator[Metric]:
    dispatched = s.scalar(select(func.coalesce(func.sum(Pack.attempts), 0))) or 0
    family = CounterMetricFamily(
        _name("packs_dispatched"), "Pack attempts handed to a queue, retries included."
    )
    family.add_metric([], int(dispatched))
    yield family
    finished = CounterMetricFamily(
        _name("packs_finished"), "Packs that reached a final status.", labels=["status"]
    )
    counts = dict.fromkeys(sorted(status.value for status in FINISHED_PACK), 0)
    stmt = (
        select(Pack.status, func.count())
        .where(Pack.status.in_(FINISHED_PACK))
        .group_by(Pack.status)
    )
    for status, n in s.execute(stmt):
        counts[status.value] = n
    for name, n in counts.items():
        finished.add_metric([name], n)
    yield finished


def _seconds_between(s: Session, start: Any, end: Any) -> ColumnElement[float]:
    """``end - start`` in seconds, in the database's own date arithmetic."""
    if s.get_bind().dialect.name == "sqlite":
        return cast((func.julianday(end) - func.julianday(start)) * 86400.0, Float)
    return cast(func.extract("epoch", end - start), Float)


def _pack_durations(s: Session) -> HistogramMetricFamily:
    """Bucket counts computed in one aggregate query, not one row per pack."""
    duration = _seconds_between(s, Pack.started_at, Pack.finished_at)
    ran = and_(
        Pack.status.in_(FINISHED_PACK),
        Pack.started_at.is_not(None),
        Pack.finished_at.is_not(None),
    )
    columns: list[Any] = [func.count(), func.coalesce(func.sum(duration), 0.0)]
    columns += [func.sum(case((duration <= bound, 1), else_=0)) for bound in DURATION_BUCKETS]
    total, seconds, *cumulative = s.execute(select(*columns).where(ran)).one()
    pairs = zip(DURATION_BUCKETS, cumulative, strict=True)
    buckets = [(repr(bound), int(n or 0)) for bound, n in pairs]
    buckets.append(("+Inf", int(total)))
    family = HistogramMetricFamily(
        _name("pack_duration_seconds"), "Seconds from claim to finish of packs that ran."
    )
    family.add_metric([], buckets=buckets, sum_value=float(seconds))
    return family


def _profiles(s: Session) -> Iterator[Metric]:
    """Per workload and device kind, not per fusion key: a key is a structural config's JSON,
    one per distinct architecture a study samples, so as a label it would grow without
    bound. The per-key figures are in the database (and ``packtune check``)."""
    key = ["workload", "device_kind"]
    speed = GaugeMetricFamily(
        _name("trial_steps_per_second"),
        "Measured trial-steps per second of fused arrays of size k (moving average), the "
        "median over the workload's fusion keys.",
        labels=[*key, "k"],
    )
    memory = GaugeMetricFamily(
        _name("memory_model_bytes"),
        "Memory model bytes(k) = base + k * per_trial: the largest over the workload's "
        "fusion keys.",
        labels=[*key, "part"],
    )
    keys = GaugeMetricFamily(_name("fusion_keys"), "Fusion keys measured (profiles).", labels=key)
    speeds: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    parts: dict[tuple[str, str, str], int] = {}
    counted: dict[tuple[str, str], int] = defaultdict(int)
    for profile in s.scalars(select(Profile).order_by(Profile.id)):
        labels = (profile.workload, profile.device_kind)
        counted[labels] += 1
        for k, value in (profile.throughput or {}).items():
            speeds[(*labels, str(k))].append(float(value))
        for part, value in (("base", profile.base_bytes), ("per_trial", profile.per_trial_bytes)):
            if value is not None:
                parts[(*labels, part)] = max(parts.get((*labels, part), 0), value)
    for labels3, values in sorted(speeds.items(), key=lambda kv: (kv[0][:2], int(kv[0][2]))):
        speed.add_metric(list(labels3), statistics.median(values))
    for labels3, value in sorted(parts.items()):
        memory.add_metric(list(labels3), value)
    for labels2, n in sorted(counted.items()):
        keys.add_metric(list(labels2), n)
    yield speed
    yield memory
    yield keys


def _workers(s: Session, timeout_seconds: float) -> Iterator[Metric]:
    alive = GaugeMetricFamily(
        _name("worker_alive"),
        "1 when the worker sent a heartbeat within the timeout.",
        labels=["worker", "host", "device_kind"],
    )
    gpu_labels = ["worker", "gpu", "name"]
    doc = "From the worker's latest NVML heartbeat; live workers only."
    used = GaugeMetricFamily(_name("worker_gpu_memory_used_bytes"), doc, labels=gpu_labels)
    free = GaugeMetricFamily(_name("worker_gpu_memory_free_bytes"), doc, labels=gpu_labels)
    total = GaugeMetricFamily(_name("worker_gpu_memory_total_bytes"), doc, labels=gpu_labels)
    util = GaugeMetricFamily(_name("worker_gpu_utilization_ratio"), doc, labels=gpu_labels)
    cutoff = datetime.now(UTC) - timedelta(seconds=timeout_seconds)
    for worker in s.scalars(select(Worker).order_by(Worker.name)):
        live = worker.status != WorkerStatus.dead and worker.last_heartbeat >= cutoff
        alive.add_metric([worker.name, worker.host, worker.device_kind], 1 if live else 0)
        if not live:
            continue
        for position, gpu in enumerate(worker.gpus or []):
            if not isinstance(gpu, dict):
                continue
            labels = [worker.name, str(gpu.get("index", position)), str(gpu.get("name", ""))]
            for family, field, scale in (
                (used, "memory_used", 1.0),
                (free, "memory_free", 1.0),
                (total, "memory_total", 1.0),
                (util, "utilization", 0.01),
            ):
                value = gpu.get(field)
                if isinstance(value, int | float) and not isinstance(value, bool):
                    family.add_metric(labels, value * scale)
    yield from (alive, used, free, total, util)
