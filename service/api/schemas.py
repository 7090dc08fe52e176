"""What the API sends back, one model per resource; lists come as ``{"data", "count"}``.

The request body of ``POST /api/studies`` is :class:`packtune.spec.StudySpec`
itself. These models mirror the dicts :mod:`service.queries` returns; they
exist for the OpenAPI schema and to pin the wire format.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from packtune.spec import Label, Priority
from service.models import PackStatus, StudyStatus, TrialStatus, WorkerStatus

T = TypeVar("T")


class Problem(BaseModel):
    """Every error but 422 (whose ``detail`` lists the fields at fault)."""

    detail: str


def problems(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for the error statuses a route can answer."""
    said = {
        401: "POST without the right bearer token (when PACKTUNE_API_TOKEN is set).",
        404: "No study with that id.",
        409: "The study can no longer change that way.",
        413: "Request body over the size limit.",
        503: "The database is unreachable; try again.",
    }
    return {code: {"model": Problem, "description": said[code]} for code in codes}


class ListOf(BaseModel, Generic[T]):
    data: list[T]
    count: int


class Objective(BaseModel):
    metric: str
    mode: Literal["min", "max"]


class Progress(BaseModel):
    """Rung-units finished out of those the full Hyperband plan would run. ``done`` counts
    the units that failed too (a failed trial's last: it was not trained), so that a study's
    bar reaches its total however its trials end; ``failed`` says how many of them failed."""

    done: int
    total: int
    failed: int = 0


class BestTrial(BaseModel):
    id: int
    config: dict[str, Any]
    metrics: dict[str, Any]


class TrialPublic(BaseModel):
    id: int
    sample_index: int
    iteration: int
    bracket: int
    rung: int
    status: TrialStatus
    config: dict[str, Any]
    fusion_key: str
    resource: float
    measured_resource: float | None
    metrics: dict[str, Any]
    error: str | None
    updated_at: datetime


class LeaderboardEntry(TrialPublic):
    rank: int
    value: float | None  # the objective at ``measured_resource``; null when not finite


class BudgetPublic(BaseModel):
    """What the study may spend and has spent (``null``: no such limit)."""

    sampler: str
    max_iterations: int | None
    iterations: int = Field(description="Hyperband iterations started")
    max_trials: int | None
    trials: int = Field(description="trials sampled")
    max_seconds: float | None
    seconds: float | None = Field(description="since the study started (to its end)")
    target: float | None
    stop_reason: str | None = Field(description="the budget that ended the study, if one did")


class FleetPublic(BaseModel):
    """The study's place among the studies sharing the fleet."""

    priority: float = Field(description="its weight in the fair share of device time")
    owner: str | None = Field(description="who it is for (the spec's owner label)")
    share: float | None = Field(
        description="its fair share of device time among the running studies now (priority "
        "over the running studies' sum); null when it is not running"
    )
    device_seconds: float = Field(
        description="device time its trials have trained (a shared pack's time split by work)"
    )
    waiting_seconds: float = Field(
        description="since it started (to its end), seconds during which none of its "
        "trials was training"
    )


class StudyPatch(BaseModel):
    """What may change while a study runs: its place in the fleet (the next tick uses it).
    As strict as a spec: ``"2"`` or ``true`` is not a priority. ``null`` puts a field back
    as a spec without it has it: priority 1, no owner."""

    model_config = ConfigDict(extra="forbid", strict=True)

    priority: Priority | None = Field(
        default=None, description="Its weight in the fair share of device time; null: 1."
    )
    owner: Label | None = Field(default=None, description="A user or team label; null: none.")


class StudyPublic(BaseModel):
    id: int
    name: str
    workload: str
    status: StudyStatus
    seed: int
    objective: Objective
    spec: dict[str, Any] | None = Field(
        default=None,
        description="The study's spec: in GET /api/studies/{id}; null in the list of studies.",
    )
    error: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    progress: Progress
    budget: BudgetPublic
    trial_counts: dict[str, int]
    packs_running: int
    fleet: FleetPublic
    best_trial: BestTrial | None
    best_so_far: LeaderboardEntry | None = None


class RungTrial(BaseModel):
    trial_id: int
    status: TrialStatus
    promoted: bool


class RungPublic(BaseModel):
    rung: int
    n: int
    resource: float
    trials: list[RungTrial]


class BracketPublic(BaseModel):
    iteration: int
    s: int
    rungs: list[RungPublic]


class PackMemberPublic(BaseModel):
    trial_id: int
    fusion_key: str
    from_resource: float
    to_resource: float
    segment: int | None = Field(
        default=None,
        description="the one segment of the trial's decoupled model this unit trains "
        "(training.units: segment); null: the whole trial",
    )


class StackRun(BaseModel):
    trials: list[int]
    #: ``bmm``: hand-fused; ``vmap``; ``serial``: one member at a time
    mode: Literal["bmm", "vmap", "serial"]
    #: trained through a compiled step (``PACKTUNE_COMPILE_STEP``)
    compiled: bool = False


class ArrayRun(BaseModel):
    """How one array of a pack ran: its stacks, what the worker noted (a vmap step that
    fell back to one member at a time, members stacked apart), the trials that raised."""

    trials: list[int]
    stacks: list[StackRun]
    notes: list[str]
    failed: list[int]
    #: it stopped short (at a training step, or before it began): the pack gave its device
    #: up to a study with a better fair share, and its trials were planned again from there
    gave_up: bool = False
    #: the segment of its trials' decoupled models it trained (training.units: segment)
    segment: int | None = None


class PackPublic(BaseModel):
    id: int
    status: PackStatus
    members: list[PackMemberPublic] = Field(description="its units of this study's trials")
    shared_trials: int = Field(
        default=0, description="trials of other studies in the same pack (planned together)"
    )
    shared_with: list[int] = Field(default=[], description="those studies' ids")
    device: str | None
    worker: str | None
    estimated_bytes: int | None
    peak_bytes: int | None
    train_seconds: float | None
    created_at: datetime
    enqueued_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    duration: float | None
    attempts: int
    error: str | None
    parent_id: int | None
    #: how each array ran (null until the pack completed, and for packs from before)
    arrays: list[ArrayRun] | None = None
    #: trials of this pack whose workload raised (isolated and failed): the pack completed
    #: for the others
    failed_trials: list[int] = []
    #: when the scheduler asked it to give its device up (a study with a better fair share
    #: waited), and whether it did: it then stopped at a training step, its trials planned
    #: again from there
    yield_requested_at: datetime | None = None
    yielded: bool = False


class CurvePoint(BaseModel):
    resource: float
    metrics: dict[str, Any]


class CurvePublic(BaseModel):
    trial_id: int
    points: list[CurvePoint]


class ThroughputPoint(BaseModel):
    k: int = Field(description="array size (trials fused into one model)")
    steps_per_s: float = Field(description="trial-steps per second measured at that size")


class ProfilePublic(BaseModel):
    fusion_key: str
    device_kind: str
    base_bytes: int | None = Field(description="memory model: bytes(k) = base + k * per_trial")
    per_trial_bytes: int | None
    throughput: list[ThroughputPoint] = Field(
        description="the measured curve of one array of k trials training alone, by k"
    )
    concurrent: list[ThroughputPoint] = Field(
        description="the measured curve of a pack's arrays of k trials training at once "
        "(threads; on a GPU each on its own stream): the whole pack's trial-steps/s, by k"
    )
    array_size: int | None = Field(
        description="the array size the planner cuts a group of ready units to, where one array "
        "alone peaks (every larger size measured alone 10% slower): the best of the two curves "
        "up to that peak (a larger size only where it gains 10%); null: not cut by measurement "
        "(the curve alone rises, is flat or is unmeasured), each group one array per pack"
    )
    at_once: bool = Field(
        description="the chosen size was measured faster with several arrays at once than alone"
    )
    capped: bool = Field(description="the study's max_pack_size holds it below the curve's choice")
    updated_at: datetime


class WorkerPublic(BaseModel):
    name: str
    host: str
    device_kind: str
    gpus: list[Any]
    memory_budget: int | None
    status: WorkerStatus
    started_at: datetime
    last_heartbeat: datetime
    alive: bool


class WorkloadPublic(BaseModel):
    name: str
    params: dict[str, Any]
    structural: list[str] = Field(
        description="Parameters that the members of one fused array share (all not fusible)."
    )
    fusible: list[str] = Field(
        description="Parameters that may differ inside one fused array (carried per member)."
    )
    metrics: dict[str, Literal["min", "max"]] | None = Field(
        description="Metrics a trial records, each with its better direction; null: the "
        "workload does not declare them."
    )
    doc: str


class Health(BaseModel):
    status: Literal["ok", "unavailable"]
    detail: str | None = None


class ErrorDetail(BaseModel):
    detail: str | list[dict[str, Any]]


class CheckRequest(BaseModel):
    """What ``POST /api/workloads/{name}/check`` checks: members drawn from ``space`` (a
    study's space; omitted: the workload's defaults with learning rates over a decade)."""

    model_config = ConfigDict(extra="forbid")

    space: dict[str, Any] | None = None
    members: Annotated[int, Field(ge=2, le=64)] = 4
    steps: Annotated[int, Field(ge=1, le=1000)] = 5


class CheckPublic(BaseModel):
    id: int
    workload: str
    status: Literal["queued", "running", "passed", "failed", "error"]
    request: dict[str, Any]
    #: once run: structural, fusible, members, max_difference, exact, stacks
    #: ([member keys, forward]), step_ms ({k: ms}), warnings, split, ok, spill_problem and
    #: decoupled_problem (why a trial could not train spilled or decoupled; null: it can)
    report: dict[str, Any] | None
    error: str | None
    worker: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
