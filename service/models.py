"""SQLAlchemy 2 models: the only place ORM classes are defined.

Everything the scheduler decides is a row here; no process keeps state of its
own. Statuses are enums (stored as strings, so SQLite and PostgreSQL agree).

Trial life cycle (one bracket, rungs ``0 … s``)::

    pending ──(put in a pack)──> queued ──> running ──> paused (reached its rung's resource)
       ^                                                  │ rung complete
       └────────── promoted to the next rung ─────────────┤
                                              not promoted └──> stopped
    last rung reached ──> completed;   non-finite loss ──> diverged;
    workload raised / attempts spent ──> failed;   study cancelled ──> cancelled
"""

from __future__ import annotations

import enum
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Enum,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC datetime on every backend.

    PostgreSQL keeps the offset; SQLite stores the wall time without one and
    hands back naive values. Values are converted to UTC on the way in (naive
    ones are taken to be UTC already) and tagged as UTC on the way out, so
    SQLite's stored strings compare in time order and reads compare with
    ``utcnow()``.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None or value.tzinfo is None:
            return value
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON}


def _enum(cls: type[enum.Enum]) -> Enum:
    # Strings in the database (no native PG enum types): migrations stay simple.
    return Enum(
        cls,
        native_enum=False,
        length=16,
        validate_strings=True,
        values_callable=lambda e: [m.value for m in e],
    )


class StudyStatus(enum.StrEnum):
    pending = "pending"
    running = "running"
    completed = "completed"
    failed = "failed"
    cancelled = "cancelled"


class TrialStatus(enum.StrEnum):
    pending = "pending"
    queued = "queued"
    running = "running"
    paused = "paused"
    stopped = "stopped"
    completed = "completed"
    diverged = "diverged"
    failed = "failed"
    cancelled = "cancelled"


class PackStatus(enum.StrEnum):
    pending = "pending"  # planned, not yet handed to a queue
    queued = "queued"  # handed to RQ / the in-process runner
    running = "running"
    completed = "completed"
    failed = "failed"  # this attempt failed; re-queued as a new attempt or trials failed
    # CUDA out of memory: replaced by two smaller packs. (The member shadows
    # str.split on purpose; PackStatus.split is the status, not the method.)
    split = "split"  # type: ignore[assignment]
    cancelled = "cancelled"


class WorkerStatus(enum.StrEnum):
    idle = "idle"
    busy = "busy"
    dead = "dead"


#: SQLite reuses the largest id of a table once its row is deleted, unless the table is
#: AUTOINCREMENT: a deleted study's id (and its trials' and packs') would name a new one,
#: and a script or a dashboard tab holding it would act on another study. Never reused.
NEVER_REUSE_IDS = {"sqlite_autoincrement": True}


class Study(Base):
    __tablename__ = "studies"
    __table_args__ = NEVER_REUSE_IDS

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    workload: Mapped[str] = mapped_column(String(100))
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    seed: Mapped[int] = mapped_column(BigInteger, default=0)
    status: Mapped[StudyStatus] = mapped_column(_enum(StudyStatus), default=StudyStatus.pending)
    best_trial_id: Mapped[int | None] = mapped_column(
        ForeignKey("trials.id", use_alter=True, name="fk_studies_best_trial", ondelete="SET NULL"),
        nullable=True,
    )
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    # why a study with a budget stopped before its last iteration (e.g. "max_seconds")
    stop_reason: Mapped[str | None] = mapped_column(String(200), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    #: seconds since ``started_at`` that are not its running time (its ``max_seconds``
    #: budget): sat failed before a retry, or with no scheduler after an interruption
    idle_seconds: Mapped[float] = mapped_column(Float, default=0.0, server_default="0")
    #: while running with no scheduler: when the one that ran it stopped
    interrupted_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)

    trials: Mapped[list[Trial]] = relationship(
        back_populates="study", foreign_keys="Trial.study_id", cascade="all, delete-orphan"
    )


class Trial(Base):
    __tablename__ = "trials"
    __table_args__ = (
        UniqueConstraint("study_id", "sample_index", name="uq_trials_study_sample"),
        Index("ix_trials_study_status_rung", "study_id", "status", "rung"),
        Index("ix_trials_study_bracket_rung", "study_id", "iteration", "bracket", "rung"),
        Index("ix_trials_study_measured", "study_id", "measured_resource", "objective"),
        Index("ix_trials_study_id", "study_id", "id"),
        NEVER_REUSE_IDS,
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    study_id: Mapped[int] = mapped_column(ForeignKey("studies.id", ondelete="CASCADE"))
    sample_index: Mapped[int] = mapped_column(Integer)  # position in the study's seeded stream
    # the Hyperband iteration (0, 1, ...: the outer loop repeated) and the bracket's s in it
    iteration: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    bracket: Mapped[int] = mapped_column(Integer)  # Hyperband's s
    rung: Mapped[int] = mapped_column(Integer, default=0)  # current rung i
    config: Mapped[dict[str, Any]] = mapped_column(JSON)
    fusion_key: Mapped[str] = mapped_column(String(500))
    status: Mapped[TrialStatus] = mapped_column(_enum(TrialStatus), default=TrialStatus.pending)
    resource_done: Mapped[float] = mapped_column(Float, default=0.0)  # cumulative resource trained
    checkpoint_path: Mapped[str | None] = mapped_column(Text, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    # Copied from the measurement at the largest resource (store.record_measurement) so that
    # the leaderboard ranks in SQL: that resource, and the objective there if finite.
    measured_resource: Mapped[float | None] = mapped_column(Float, nullable=True)
    objective: Mapped[float | None] = mapped_column(Float, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow, onupdate=utcnow)

    study: Mapped[Study] = relationship(back_populates="trials", foreign_keys=[study_id])
    measurements: Mapped[list[Measurement]] = relationship(
        back_populates="trial", cascade="all, delete-orphan", order_by="Measurement.resource"
    )


class RungPromotion(Base):
    """One row per trial promoted out of a rung: ``trial`` went from ``rung`` to ``rung + 1``."""

    __tablename__ = "rung_promotions"
    __table_args__ = (
        UniqueConstraint("trial_id", "rung", name="uq_promotions_trial_rung"),
        Index("ix_promotions_study_bracket", "study_id", "bracket"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    study_id: Mapped[int] = mapped_column(ForeignKey("studies.id", ondelete="CASCADE"))
    trial_id: Mapped[int] = mapped_column(ForeignKey("trials.id", ondelete="CASCADE"))
    iteration: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    bracket: Mapped[int] = mapped_column(Integer)
    rung: Mapped[int] = mapped_column(Integer)
    value: Mapped[float | None] = mapped_column(Float, nullable=True)  # objective when promoted
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class Pack(Base):
    """What one job runs on one device: one or more fused arrays."""

    __tablename__ = "packs"
    __table_args__ = (
        Index("ix_packs_study_status", "study_id", "status"),
        Index("ix_packs_study_id", "study_id", "id"),
        NEVER_REUSE_IDS,
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    study_id: Mapped[int] = mapped_column(ForeignKey("studies.id", ondelete="CASCADE"))
    status: Mapped[PackStatus] = mapped_column(_enum(PackStatus), default=PackStatus.pending)
    device: Mapped[str | None] = mapped_column(String(200), nullable=True)  # e.g. "worker-1/cuda:0"
    worker_name: Mapped[str | None] = mapped_column(String(200), nullable=True)
    job_id: Mapped[str | None] = mapped_column(String(200), nullable=True)
    parent_id: Mapped[int | None] = mapped_column(ForeignKey("packs.id"), nullable=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    #: attempts that ended in a fault that is not the trials' (they do not count)
    faults: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    #: a failed pack is not dispatched again before this (backoff)
    retry_after: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    #: set while it runs when a study with a better fair share waits for its device: the
    #: pack stops at its next training step and its trials are planned again from there
    yield_requested_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    estimated_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    peak_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    train_seconds: Mapped[float | None] = mapped_column(Float, nullable=True)
    #: device-seconds of its earlier attempts, those that ended without finishing it (a
    #: failed job, a lost worker): charged to its studies with the current attempt's time
    spent_seconds: Mapped[float] = mapped_column(Float, default=0.0, server_default="0")
    #: device-seconds of it charged to studies since deleted (their members went with them),
    #: up to their deletion: charged to nobody, not to the studies left in it
    departed_seconds: Mapped[float] = mapped_column(Float, default=0.0, server_default="0")
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    #: how each array ran, written when the pack completes: [{"trials": [...], "stacks":
    #: [{"trials": [...], "mode": "bmm" | "vmap" | "serial"}], "notes": [...],
    #: "failed": [trial ids that raised and were failed]}]
    arrays: Mapped[list[Any] | None] = mapped_column(JSON, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    enqueued_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)

    members: Mapped[list[PackMember]] = relationship(
        back_populates="pack", cascade="all, delete-orphan", order_by="PackMember.trial_id"
    )


class PackMember(Base):
    """One unit of work in a pack: train ``trial`` from ``from_resource`` to ``to_resource``;
    ``segment``: only that segment of the trial's decoupled model (``-1``: the whole trial);
    ``array_no``: the pack's array it trains in."""

    __tablename__ = "pack_members"
    __table_args__ = (Index("ix_pack_members_trial", "trial_id"),)

    pack_id: Mapped[int] = mapped_column(
        ForeignKey("packs.id", ondelete="CASCADE"), primary_key=True
    )
    trial_id: Mapped[int] = mapped_column(
        ForeignKey("trials.id", ondelete="CASCADE"), primary_key=True
    )
    segment: Mapped[int] = mapped_column(
        Integer, primary_key=True, default=-1, server_default=text("-1")
    )
    fusion_key: Mapped[str] = mapped_column(String(500))
    from_resource: Mapped[float] = mapped_column(Float)
    to_resource: Mapped[float] = mapped_column(Float)
    # which of the pack's arrays it trains in (the planner cuts a key's units by the
    # measured array size; members of one key and span in different arrays train apart)
    array_no: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))

    pack: Mapped[Pack] = relationship(back_populates="members")


class Measurement(Base):
    """A trial's metrics at one cumulative resource; a repeated report updates the row."""

    __tablename__ = "measurements"
    __table_args__ = (
        UniqueConstraint("trial_id", "resource", name="uq_measurements_trial_resource"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    trial_id: Mapped[int] = mapped_column(ForeignKey("trials.id", ondelete="CASCADE"))
    resource: Mapped[float] = mapped_column(Float)
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)

    trial: Mapped[Trial] = relationship(back_populates="measurements")


class Worker(Base):
    __tablename__ = "workers"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    host: Mapped[str] = mapped_column(String(200))
    device_kind: Mapped[str] = mapped_column(String(200))  # "cpu" or the GPU's NVML name
    gpus: Mapped[list[Any]] = mapped_column(JSON, default=list)  # per-GPU NVML readings
    memory_budget: Mapped[int | None] = mapped_column(BigInteger, nullable=True)  # CPU workers
    status: Mapped[WorkerStatus] = mapped_column(_enum(WorkerStatus), default=WorkerStatus.idle)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    last_heartbeat: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class Profile(Base):
    """Memory model and throughput table for one (workload, fusion key, device kind)."""

    __tablename__ = "profiles"
    __table_args__ = (
        UniqueConstraint("workload", "fusion_key", "device_kind", name="uq_profiles_key"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    workload: Mapped[str] = mapped_column(String(100))
    fusion_key: Mapped[str] = mapped_column(String(500))
    device_kind: Mapped[str] = mapped_column(String(200))
    base_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    per_trial_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    # {"<k>": trial-steps per second} measured for fused arrays of size k
    throughput: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    # {"<k>": trial-steps per second} a pack reached with its arrays of k trials of this key
    # trained at once (threads; on a GPU each its own stream)
    concurrent: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow, onupdate=utcnow)


class Lease(Base):
    """A named lease (e.g. the scheduler's); the holder renews it before ``expires_at``."""

    __tablename__ = "leases"

    name: Mapped[str] = mapped_column(String(100), primary_key=True)
    holder: Mapped[str] = mapped_column(String(200))
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime())


class CheckStatus(enum.StrEnum):
    queued = "queued"  # waiting for a worker (``job_id`` set once dispatched)
    running = "running"
    passed = "passed"  # fusion is exact and possible
    failed = "failed"  # the check ran and found fusion wrong or impossible
    error = "error"  # the check could not run (the workload raised, the worker died)


class WorkloadCheck(Base):
    """A ``packtune check`` asked for through the API, run by a worker (the device is
    there): the request, and the report once done."""

    __tablename__ = "workload_checks"
    __table_args__ = (Index("ix_workload_checks_status", "status"), NEVER_REUSE_IDS)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    workload: Mapped[str] = mapped_column(String(100))
    request: Mapped[dict[str, Any]] = mapped_column(JSON)  # space, members, steps
    status: Mapped[CheckStatus] = mapped_column(_enum(CheckStatus), default=CheckStatus.queued)
    report: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    job_id: Mapped[str | None] = mapped_column(String(100), nullable=True)
    worker_name: Mapped[str | None] = mapped_column(String(200), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
