"""The study spec: the JSON body of ``POST /api/studies`` and the YAML file of ``packtune run``.

:class:`StudySpec` checks the shape (types, ranges, unknown keys) and, in one
``after`` validator, what needs the other fields: the workload is registered,
the space parses and names only parameters the workload takes, and the
Hyperband settings imply a study of sane size. Those checks raise
:class:`~packtune.errors.SpecError` carrying a dotted ``field`` such as
``space.lr.low``; pydantic wraps it, and :func:`spec_error_of` gets it back.

:func:`validate_spec` is what callers use: any problem comes out as one
``SpecError(field, message)``, the first pydantic finds. The module is pure:
no database, no torch (workloads are looked up by name only).
"""

from __future__ import annotations

import itertools
import math
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails

from packtune.declared import check_decoupled, check_objective, ends
from packtune.errors import SpecError
from packtune.hyperband import Rung, plan_brackets, s_max, total_trials
from packtune.sampling import RANDOM_FRACTION, SamplerName
from packtune.schedules import LIMITS as SCHEDULE_LIMITS
from packtune.schedules import SCHEDULES
from packtune.space import Choice, Dimension, Int, parse_space
from packtune.workloads.base import OPTIMIZERS, PRECISIONS, RESERVED

# A study bigger than this is almost certainly a unit mistake (steps for epochs).
MAX_RESOURCE_LIMIT = 10_000
MAX_TRIALS = 100_000
#: iterations of a study whose budget is time, trials or a target (not a count)
MAX_ITERATIONS = 1_000


def unprintable(value: str) -> str | None:
    """The first character of ``value`` that has no place in a name, described; else None.

    Control characters (C0 and C1, e.g. U+0085), format characters (bidi overrides and
    isolates, zero-width spaces and joiners, U+FEFF) and line or paragraph separators can
    make a name render as something else, or break a log line; a NUL cannot even be stored
    in PostgreSQL text.
    """
    for c in value:
        if unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp"):
            return f"U+{ord(c):04X} ({unicodedata.name(c, 'a control character')})"
    return None


def _printable(value: str) -> str:
    bad = unprintable(value)
    if bad is not None:
        raise ValueError(f"must not contain control or invisible characters; found {bad}")
    return value


# No control or invisible characters (see :func:`unprintable`).
Name = Annotated[
    str,
    StringConstraints(strip_whitespace=True, min_length=1, max_length=200),
    AfterValidator(_printable),
]
#: a user or team label (a study's ``owner``): as a name, shorter
Label = Annotated[
    str,
    StringConstraints(strip_whitespace=True, min_length=1, max_length=100),
    AfterValidator(_printable),
]
Resource = Annotated[float, Field(gt=0, allow_inf_nan=False)]
#: a study's weight in the fair share: within a millionfold of each other (a priority of
#: 1e-320 was taken, and its study's fair-share level, device-seconds / priority, became
#: infinite)
Priority = Annotated[float, Field(ge=0.001, le=1_000, allow_inf_nan=False)]


class _Strict(BaseModel):
    # strict: "27" or true is not a number; JSON and YAML carry real ones.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Objective(_Strict):
    """The metric trials are ranked by; a spec that gives no ``mode`` (``min``/``max``)
    gets the direction the workload declares for the metric (``Workload.reports``), else
    ``min`` (:func:`declared_mode`)."""

    metric: Annotated[str, StringConstraints(min_length=1, max_length=100)] = "val_loss"
    mode: Literal["min", "max"] = "min"


class HyperbandSettings(_Strict):
    """R (``max_resource``), r_min (``min_resource``) and eta, in the study's resource unit."""

    max_resource: Resource
    min_resource: Resource = 1.0
    eta: Annotated[int, Field(ge=2, le=1_000)] = 3

    @field_validator("max_resource")
    @classmethod
    def _not_absurd(cls, value: float) -> float:
        if value > MAX_RESOURCE_LIMIT:
            raise SpecError(
                "hyperband.max_resource",
                f"must be at most {MAX_RESOURCE_LIMIT} (got {value}); the resource unit is "
                "epochs, not steps",
            )
        return value

    @model_validator(mode="after")
    def _ordered(self) -> HyperbandSettings:
        if self.max_resource < self.min_resource:
            raise SpecError(
                "hyperband.max_resource",
                f"must be >= min_resource ({self.min_resource}), got {self.max_resource}",
            )
        return self


class PackingSettings(_Strict):
    enabled: bool = True
    max_pack_size: Annotated[int, Field(ge=1)] | None = None
    #: cut units at every rung resource of the study, so that brackets share arrays
    align_rungs: bool = True

    @model_validator(mode="after")
    def _size_needs_packing(self) -> PackingSettings:
        if not self.enabled and self.max_pack_size is not None:
            raise SpecError("packing.max_pack_size", "applies only with packing enabled: true "
                            "(unpacked, every trial trains alone)")  # fmt: skip
        return self


class SamplerSettings(_Strict):
    """How configurations are drawn (:mod:`packtune.sampling`): ``tpe`` (model-based, the
    default) or ``random``; ``random_fraction`` of the model-based draws stay random."""

    name: SamplerName = "tpe"
    random_fraction: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] = RANDOM_FRACTION

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        return {"name": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _fraction_needs_a_model(self) -> SamplerSettings:
        # compared with the default, not with what was given: a spec dumped whole (the CLI
        # submits one) names every field
        if self.name == "random" and self.random_fraction != RANDOM_FRACTION:
            raise SpecError("sampler.random_fraction", "applies only to sampler tpe (random "
                            "draws every configuration at random)")  # fmt: skip
        return self


class TrainingSettings(_Strict):
    """How each trial's model trains: ``end_to_end`` (back-propagation through the whole
    model), or ``decoupled``: its chain of layers (an ``nn.Sequential``) cut into
    ``segments`` that learn independently, each against a fixed random target vector per
    class at its cut (synthetic intermediate labels, drawn from the study seed), segment
    after the first from the previous cut's label with Gaussian ``noise``; the composed
    model is evaluated. For in-memory classification workloads with the plain step.

    ``units``: what the scheduler plans as a unit of work. ``trial``: a trial's segments
    train together in its array, every epoch evaluated. ``segment``: each segment of a
    trial's rung span is a unit of its own, fused with the same segment of other trials
    and run on whichever device is free (a trial's segments on several devices at once);
    the composed model is evaluated when the last of its segments ends the span (the
    trial's curve then has a point per rung, not per epoch)."""

    mode: Literal["end_to_end", "decoupled"] = "end_to_end"
    segments: Annotated[int, Field(ge=2, le=16)] = 2
    noise: Annotated[float, Field(ge=0, le=10, allow_inf_nan=False)] = 0.1
    units: Literal["trial", "segment"] = "trial"

    @model_validator(mode="after")
    def _units_need_segments(self) -> TrainingSettings:
        if self.units == "segment" and self.mode != "decoupled":
            raise SpecError("training.units", "segment needs mode: decoupled (an end-to-end "
                            "model has no segments)")  # fmt: skip
        # compared with the defaults, not with what was given: a spec dumped whole names all
        defaults = TrainingSettings.model_fields
        for field in ("segments", "noise"):
            if self.mode == "end_to_end" and getattr(self, field) != defaults[field].default:
                raise SpecError(f"training.{field}", "applies only to mode: decoupled (an "
                                "end-to-end model is not cut)")  # fmt: skip
        return self

    @property
    def lane(self) -> str:
        """What trials must share to train in one array (empty for end to end)."""
        if self.mode == "end_to_end":
            return ""
        units = ":segment-units" if self.units == "segment" else ""
        return f"decoupled:{self.segments}:{self.noise!r}{units}"

    @property
    def segment_units(self) -> int:
        """How many units of work a trial's rung span is: its segments with ``units:
        segment``, else 0 (the trial is one unit)."""
        return self.segments if self.units == "segment" else 0


class Budget(_Strict):
    """How much a study may spend: Hyperband's outer loop is repeated (each iteration's
    sampler learning from every earlier one) until the first of these is reached.

    ``max_iterations`` left out is 1 when no other budget is set, else as many as the other
    budgets allow (at most :data:`MAX_ITERATIONS`). ``max_trials`` counts sampled trials: an
    iteration's bracket is started only if all of its trials fit. ``max_seconds`` counts
    the study's running time (from its start, less the time it sat failed or with no
    scheduler); ``target`` is an objective value that, once reached at
    ``max_resource``, ends the study. A study ended by ``max_seconds`` or ``target`` stops
    its running packs and completes with the best trial so far (``stop_reason`` says why).
    """

    max_iterations: Annotated[int, Field(ge=1)] | None = None
    max_trials: Annotated[int, Field(ge=1)] | None = None
    max_seconds: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    target: Annotated[float, Field(allow_inf_nan=False)] | None = None

    def iterations(self) -> int:
        """The most iterations this budget allows."""
        if self.max_iterations is not None:
            return self.max_iterations
        others = (self.max_trials, self.max_seconds, self.target)
        return 1 if all(v is None for v in others) else MAX_ITERATIONS


def _range(kind: str, number: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "title": kind,
        "type": "object",
        "properties": {
            "type": {"const": kind}, "low": {"type": number}, "high": {"type": number},
            **(extra or {}),
        },
        "required": ["type", "low", "high"],
        "additionalProperties": False,
    }  # fmt: skip


#: The search space's JSON schema, for the OpenAPI document (``parse_space`` checks it, and
#: more: ``low <= high``, positive loguniform ends, distinct choices): parameter name ->
#: one dimension.
SPACE_SCHEMA: dict[str, Any] = {
    "description": "Each parameter the workload takes that is searched, with its dimension "
    "(the others keep the workload's defaults).",
    "additionalProperties": {
        "oneOf": [
            _range("uniform", "number"),
            _range("loguniform", "number"),
            _range("int", "integer", {"log": {"type": "boolean"}}),
            {
                "title": "choice",
                "type": "object",
                "properties": {
                    "type": {"const": "choice"},
                    "values": {
                        "type": "array", "minItems": 1, "maxItems": 1000,
                        "items": {"type": ["string", "number", "integer", "boolean", "null"]},
                    },
                },
                "required": ["type", "values"],
                "additionalProperties": False,
            },  # fmt: skip
        ]
    },
    "examples": [{"lr": {"type": "loguniform", "low": 0.001, "high": 0.3},
                  "hidden": {"type": "choice", "values": [64, 128]}}],
}  # fmt: skip


class StudySpec(_Strict):
    """A tuning study; ``examples/*.yaml`` are examples, docs/design.md says what happens to one."""

    name: Name
    workload: Annotated[str, StringConstraints(min_length=1, max_length=100)]
    objective: Objective = Objective()
    space: Annotated[dict[str, Any], Field(json_schema_extra=SPACE_SCHEMA)]
    hyperband: HyperbandSettings
    packing: PackingSettings = PackingSettings()
    sampler: SamplerSettings = SamplerSettings()
    #: ``hyperband``: synchronous halving per bracket; ``asha``: asynchronous promotions
    #: (:mod:`packtune.asha`) on the ladder of the most aggressive bracket
    scheduler: Literal["hyperband", "asha"] = "hyperband"
    budget: Budget = Budget()
    training: TrainingSettings = TrainingSettings()
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] = 0
    #: its share of device time against other running studies (weighted fair share)
    priority: Priority = 1.0
    #: who it is for (a user or team label, shown in the API and the dashboard)
    owner: Label | None = None

    @field_validator("workload")
    @classmethod
    def _registered(cls, name: str) -> str:
        known = _workloads()
        if name not in known:
            raise SpecError("workload", f"unknown workload {name!r}; known: {sorted(known)}")
        return name

    @model_validator(mode="before")
    @classmethod
    def _declared_mode(cls, raw: Any) -> Any:
        return declared_mode(raw)

    @model_validator(mode="after")
    def _consistent(self) -> StudySpec:
        check_search_space(self.workload, self.space)
        workload, space = _workloads()[self.workload], self.dimensions()
        check_objective(workload, self.objective, space)
        check_decoupled(workload, self.training, space)
        check_size(self.hyperband, self.budget)
        check_rung_steps(self.workload, self.space, self.hyperband)
        if self.scheduler == "hyperband":
            check_first_bracket(self.hyperband, self.budget)
        else:
            check_asha_ladder(self.hyperband, self.budget)
        return self

    def dimensions(self) -> dict[str, Dimension]:
        """The parsed search space."""
        return parse_space(self.space)

    def total_trials(self) -> int:
        return total_trials(self.brackets())

    def brackets(self) -> list[list[Rung]]:
        """Hyperband's plan for this spec: the same cached plan as :attr:`StoredSpec.brackets`."""
        from packtune.rungs import plan  # packtune.rungs reads StoredSpec: imported here

        hb = self.hyperband
        return plan(float(hb.max_resource), int(hb.eta), float(hb.min_resource))


@dataclass(frozen=True)
class StoredSpec:
    """A stored study's spec (the JSON of a validated :class:`StudySpec`) read once into
    typed, frozen fields, with :class:`StudySpec`'s defaults for anything it lacks.

    It is not validated again: it was when the study was created. The scheduler, the
    workers and the read side take every setting from here (``spec.objective.metric``,
    ``spec.hyperband.eta``, ``spec.brackets``), never from the raw JSON.
    """

    workload: str
    objective: Objective
    hyperband: HyperbandSettings
    packing: PackingSettings
    space: Mapping[str, Any]
    seed: int
    sampler: SamplerSettings
    budget: Budget
    scheduler: Literal["hyperband", "asha"] = "hyperband"
    priority: float = 1.0
    owner: str | None = None
    training: TrainingSettings = TrainingSettings()

    @classmethod
    def of(cls, spec: Mapping[str, Any]) -> StoredSpec:
        hb = dict(spec.get("hyperband") or {})
        sampler = spec.get("sampler")
        if isinstance(sampler, str):
            sampler = {"name": sampler}
        # a study stored before samplers existed was sampled at random
        sampler = sampler if sampler is not None else {"name": "random"}
        return cls(
            workload=str(spec.get("workload", "")),
            objective=Objective.model_construct(
                **{
                    "mode": "min",
                    **{k: v for k, v in (spec.get("objective") or {}).items() if v is not None},
                }
            ),
            hyperband=HyperbandSettings.model_construct(
                **{k: v for k, v in hb.items() if k in HyperbandSettings.model_fields}
            ),
            packing=PackingSettings.model_construct(**(spec.get("packing") or {})),
            space=spec.get("space") or {},
            seed=int(spec.get("seed", 0)),
            sampler=SamplerSettings.model_construct(**sampler),
            budget=Budget.model_construct(**(spec.get("budget") or {})),
            scheduler="asha" if spec.get("scheduler") == "asha" else "hyperband",
            priority=float(spec.get("priority") or 1.0),
            owner=spec.get("owner"),
            training=TrainingSettings.model_construct(**(spec.get("training") or {})),
        )

    @property
    def brackets(self) -> list[list[Rung]]:
        """Hyperband's plan, highest ``s`` first (cached per setting; treat as read-only)."""
        from packtune.rungs import plan  # packtune.rungs reads StoredSpec: imported here

        hb = self.hyperband
        return plan(float(hb.max_resource), int(hb.eta), float(hb.min_resource))


def _workloads() -> dict[str, Any]:
    from packtune.workloads import registry  # imports no torch

    return registry()


def check_search_space(workload: str, raw: dict[str, Any]) -> None:
    """``raw`` is a search space of ``workload``: it parses, names parameters the workload
    takes, within its bounds, and gives the shared training parameters values they know."""
    check_space(workload, raw)
    check_choices(workload, raw)
    check_training(workload, raw)
    check_types(workload, raw)
    check_bounds(workload, raw)


def check_space(workload: str, raw: dict[str, Any]) -> None:
    """``raw`` parses, and every parameter is one ``workload`` takes and not a reserved one."""
    parse_space(raw)
    params = _workloads()[workload].params
    for name in raw:
        bad = unprintable(name)
        if bad is not None:
            raise SpecError(f"space.{name!r}", f"a parameter name must not contain {bad}")
        if name in RESERVED:
            raise SpecError(f"space.{name}", "is set by packtune for every trial; remove it")
        if name not in params:
            raise SpecError(
                f"space.{name}",
                f"workload {workload!r} does not take this parameter; it takes {sorted(params)}",
            )


#: the kinds of value a parameter takes, by its default's type, in words
_KINDS: dict[type, str] = {
    bool: "true or false", int: "whole numbers", float: "numbers", str: "text",
}  # fmt: skip


def _kind(default: Any) -> type | None:
    """The kind of value a parameter of this default takes (None: not known)."""
    return type(default) if type(default) in _KINDS else None


def _of_kind(kind: type, value: Any) -> bool:
    if kind is bool or kind is str:
        return isinstance(value, kind)
    if isinstance(value, bool):
        return False
    return isinstance(value, int) if kind is int else isinstance(value, int | float)


def check_types(workload: str, raw: dict[str, Any]) -> None:
    """Every value the space gives a parameter is of the kind its default is (a whole number
    for ``hidden: 64``, a number for ``lr: 0.05``, text, or true/false): a value of another
    kind was accepted and failed every trial of it when built (``hidden: null``), or was
    cut silently (``hidden: 32.5`` trained 32)."""
    params = _workloads()[workload].params
    for name, dimension in parse_space(raw).items():
        kind = _kind(params.get(name))
        if kind is None:
            continue
        words = _KINDS[kind]
        if isinstance(dimension, Choice):
            for i, value in enumerate(dimension.values):
                if not _of_kind(kind, value):
                    raise SpecError(
                        f"space.{name}.values",
                        f"value {value!r} (position {i}) is not what {workload} takes for "
                        f"{name}: {words}",
                    )
        elif kind in (bool, str) or (kind is int and not isinstance(dimension, Int)):
            hint = "; use type: int" if kind is int else "; use type: choice"
            raise SpecError(f"space.{name}.type", f"{workload} takes {words} for {name}{hint}")


def check_bounds(workload: str, raw: dict[str, Any]) -> None:
    """Every value the space can give a bounded parameter is within the workload's bounds."""
    bounds = _workloads()[workload].bounds
    for name, dimension in parse_space(raw).items():
        if name not in bounds:
            continue
        low, high = bounds[name]
        if isinstance(dimension, Choice):
            for i, value in enumerate(dimension.values):
                if (
                    isinstance(value, int | float)
                    and not isinstance(value, bool)
                    and not (low <= value <= high)
                ):
                    raise SpecError(
                        f"space.{name}.values",
                        f"value {value!r} (position {i}) is outside what {workload} takes: "
                        f"{low:g} to {high:g}",
                    )
            continue
        for end, value in (("low", dimension.low), ("high", dimension.high)):  # type: ignore[union-attr]
            if not low <= value <= high:
                raise SpecError(
                    f"space.{name}.{end}",
                    f"{value!r} is outside what {workload} takes: {low:g} to {high:g}",
                )


def check_choices(workload: str, raw: dict[str, Any]) -> None:
    """A categorical parameter the workload lists in ``choices`` gets only values it takes."""
    choices = _workloads()[workload].choices
    for name, dimension in parse_space(raw).items():
        if name not in choices:
            continue
        known = list(choices[name])
        if not isinstance(dimension, Choice):
            raise SpecError(f"space.{name}", f"takes one of {known}: give a choice of them")
        for i, value in enumerate(dimension.values):
            if value not in known:
                raise SpecError(
                    f"space.{name}.values",
                    f"value {value!r} (position {i}) is not one {workload} takes: {known}",
                )


#: the shared training parameters that take a name, and the names each takes
TRAINING_NAMES: dict[str, tuple[str, ...]] = {
    "optimizer": OPTIMIZERS, "schedule": SCHEDULES, "precision": PRECISIONS,
}  # fmt: skip
#: the shared numeric training parameters, and the (low, high) each may take
TRAINING_LIMITS: dict[str, tuple[float, float]] = {
    **{name: (low, high) for name, low, high in SCHEDULE_LIMITS},
    "lr": (0.0, float("inf")),
    "momentum": (0.0, 1.0),
    "weight_decay": (0.0, float("inf")),
    "beta1": (0.0, 1.0),
    "beta2": (0.0, 1.0),
    "eps": (0.0, float("inf")),
    "clip_norm": (0.0, float("inf")),
    "alpha": (0.0, 1.0),
    "rho": (0.0, 1.0),
}
#: of those, the ends a value may not take: a learning rate or eps of 0, a beta of 1 (Adam's
#: bias correction would divide by zero)
TRAINING_OPEN_ENDS: dict[str, tuple[bool, bool]] = {
    "lr": (True, False), "eps": (True, False), "beta1": (False, True), "beta2": (False, True),
}  # fmt: skip


def check_training(workload: str, raw: dict[str, Any]) -> None:
    """The space gives the shared training parameters (optimizer, schedule, clipping) only
    values the fused optimizer knows, where the workload takes them; so do the workload's
    own defaults of those the space leaves out (``precision: "fp16"`` would train in fp32)."""
    params = _workloads()[workload].params
    space = parse_space(raw)
    for name, dimension in space.items():
        if name in params:
            problem = _training_problem(name, dimension)
            if problem is not None:
                raise SpecError(f"space.{name}", problem)
    for name, value in params.items():
        if name not in space and name in TRAINING_NAMES | TRAINING_LIMITS:
            problem = _training_problem(name, Choice(values=(value,)))
            if problem is not None:
                raise SpecError(
                    "workload", f"{workload!r} declares {name}={value!r} by default: {problem}"
                )


def _training_problem(name: str, dimension: Dimension) -> str | None:
    """What is wrong with ``dimension``'s values of the shared training parameter ``name``
    (None: nothing, or not one of them)."""
    if name in TRAINING_NAMES:
        known = TRAINING_NAMES[name]
        if not isinstance(dimension, Choice):
            return f"a range; give a choice of {', '.join(known)}"
        for value in dimension.values:
            if value not in known:
                return f"{value!r} is not one of {', '.join(known)}"
    elif name in TRAINING_LIMITS:
        low, high = TRAINING_LIMITS[name]
        for value in ends(dimension):
            if isinstance(value, bool) or not isinstance(value, int | float):
                return f"{value!r} is not a number"
            open_low, open_high = TRAINING_OPEN_ENDS.get(name, (False, False))
            if (
                not low <= value <= high
                or (open_low and value == low)
                or (open_high and value == high)
            ):
                shut = not open_high and math.isfinite(high)
                span = f"{'(' if open_low else '['}{low:g}, {high:g}{']' if shut else ')'}"
                return f"{value!r} is outside {span}"
    return None


def declared_mode(raw: Any) -> Any:
    """``raw`` (a spec as submitted) with ``objective.mode`` filled in from the direction its
    workload declares for the metric, when the spec gives none (``val_accuracy``: ``max``)."""
    if not isinstance(raw, dict) or not isinstance(raw.get("objective"), dict):
        return raw
    objective = raw["objective"]
    name = raw.get("workload")
    workload = _workloads().get(name) if isinstance(name, str) else None
    if "mode" in objective or workload is None:
        return raw
    better = (workload.reported_metrics() or {}).get(objective.get("metric", "val_loss"))
    return {**raw, "objective": {**objective, "mode": better}} if better else raw


#: the most combinations of the step-changing dimensions' ends :func:`fewest_steps_per_epoch`
#: tries (beyond, each dimension's ends alone)
STEP_COMBINATIONS = 4096


def fewest_steps_per_epoch(workload: str, raw: dict[str, Any]) -> int | None:
    """The fewest training steps an epoch of the workload has over the values the space
    gives: each dimension's ends or values in turn, the rest at their defaults, and every
    combination of those of the dimensions that change the steps (the smallest ``n_train``
    with the largest ``batch_size``); None where the workload cannot say without its data
    (a size it must read). A streamed workload's size is asked too: ``train_size`` needs no
    data."""
    info = _workloads()[workload]
    try:
        steps = info.steps_per_epoch
        base = int(steps({}))
        extremes = {name: ends(dimension) for name, dimension in parse_space(raw).items()}
        fewest = min([base, *(int(steps({n: v})) for n, vs in extremes.items() for v in vs)])
        moving = {n: values for n, values in extremes.items()
                  if any(int(steps({n: v})) != base for v in values)}  # fmt: skip
        if 1 < len(moving) and math.prod(len(v) for v in moving.values()) <= STEP_COMBINATIONS:
            for combo in itertools.product(*moving.values()):
                fewest = min(fewest, int(steps(dict(zip(moving, combo, strict=True)))))
        return fewest
    except Exception:  # a size the workload reads from its data, or a value it refuses
        return None


def check_rung_steps(workload: str, raw: dict[str, Any], hb: HyperbandSettings) -> None:
    """Every rung trains at least one step more than the rung before it (the first: at least
    one), at the fewest steps an epoch of the space has. A rung of no step measured nothing:
    its trials were never promoted, and the study completed with its brackets left short."""
    steps = fewest_steps_per_epoch(workload, raw)
    if steps is None:
        return
    for bracket in plan_brackets(hb.max_resource, hb.eta, hb.min_resource):
        done = 0
        for rung in bracket:
            at = round(rung.resource * steps)
            if at <= done:
                raise SpecError(
                    "hyperband.min_resource",
                    f"a rung of {rung.resource:g} epochs is {at} training steps of {workload} "
                    f"(at {steps} steps an epoch), no more than the rung before it: every rung "
                    f"must train at least one step; raise min_resource to at least "
                    f"{1 / steps:.3g} epochs (or lower eta)",
                )
            done = at


def check_first_bracket(hb: HyperbandSettings, budget: Budget) -> None:
    """Reject a ``max_trials`` below the first bracket's trials: Hyperband starts a bracket
    only when all of its trials fit, so such a study would sample nothing and fail."""
    if budget.max_trials is None:
        return
    first = plan_brackets(hb.max_resource, hb.eta, hb.min_resource)[0][0].n
    if budget.max_trials < first:
        raise SpecError(
            "budget.max_trials",
            f"{budget.max_trials} is fewer than the {first} trials of the first bracket, which "
            f"starts only when all of them fit: nothing would run; raise it to {first} or more, "
            "or use scheduler: asha",
        )


def check_asha_ladder(hb: HyperbandSettings, budget: Budget) -> None:
    """Reject a ``max_trials`` too small for ASHA to promote any trial to ``max_resource``:
    it promotes ``floor(m / eta)`` of the ``m`` results at each rung, so the top of a ladder
    of ``s_max`` promotions needs ``eta**s_max`` trials; with fewer the study fails."""
    if budget.max_trials is None:
        return
    need = hb.eta ** s_max(hb.max_resource, hb.eta, hb.min_resource)
    if budget.max_trials < need:
        raise SpecError(
            "budget.max_trials",
            f"{budget.max_trials} is fewer than the {need} trials ASHA needs to promote one to "
            f"max_resource (floor(m / eta) of m at each rung): no trial would reach it; raise "
            f"it to {need} or more",
        )


def check_size(hb: HyperbandSettings, budget: Budget | None = None) -> None:
    """Reject settings whose plan samples more than :data:`MAX_TRIALS` trials.

    The top bracket alone samples ``eta**s_max`` trials, so that is checked
    before the plan is built (a tiny ``min_resource`` would make it enormous).
    With a budget, the trials of every iteration count (up to ``max_trials``).
    """
    top = s_max(hb.max_resource, hb.eta, hb.min_resource)
    trials = hb.eta**top
    if trials <= MAX_TRIALS:
        trials = total_trials(plan_brackets(hb.max_resource, hb.eta, hb.min_resource))
    if trials > MAX_TRIALS:
        raise SpecError(
            "hyperband",
            f"these settings sample {trials} trials, more than {MAX_TRIALS}; "
            "raise min_resource or eta, or lower max_resource",
        )
    if budget is None or budget.max_iterations is None:
        return
    total = trials * budget.max_iterations
    if budget.max_trials is not None:
        total = min(total, budget.max_trials)
    if total > MAX_TRIALS:
        raise SpecError(
            "budget.max_iterations",
            f"{budget.max_iterations} iterations of {trials} trials sample {total} trials, "
            f"more than {MAX_TRIALS}; lower it or set budget.max_trials",
        )


def spec_error_of(error: ErrorDetails, prefix: tuple[str | int, ...] = ()) -> SpecError:
    """One pydantic error as a ``SpecError``; ``prefix`` is dropped from the location.

    A ``SpecError`` raised in a validator keeps its own ``field``; any other
    error is named by its location (``hyperband.eta``).
    """
    original = (error.get("ctx") or {}).get("error")
    if isinstance(original, SpecError):
        return original
    loc = tuple(error["loc"])
    if prefix and loc[: len(prefix)] == prefix:
        loc = loc[len(prefix) :]
    field = ".".join(str(part) for part in loc) or "spec"
    message = error["msg"]
    if error["type"] == "extra_forbidden":
        message = "unknown key"
    elif error["type"] == "missing":
        message = "is required"
    return SpecError(field, message)


def validate_spec(raw: Any) -> StudySpec:
    """A checked :class:`StudySpec` from JSON-like ``raw``, or ``SpecError`` naming the field."""
    if isinstance(raw, StudySpec):
        return raw
    if not isinstance(raw, dict):
        raise SpecError("spec", f"must be a mapping, got {type(raw).__name__}")
    try:
        return StudySpec.model_validate(raw)
    except ValidationError as exc:
        raise spec_error_of(exc.errors()[0]) from None
