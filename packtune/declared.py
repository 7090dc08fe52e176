"""A study checked against what its workload declares of each configuration, without torch.

A workload may say, per configuration, which metrics it reports
(:meth:`~packtune.workloads.base.Workload.reports_for`), whether its targets are class
labels (``class_targets``) and how many segments its model can be cut into
(``max_segments``). :func:`corners` asks it about the configurations at the corners of a
study's space; :func:`check_objective` and :func:`check_decoupled` raise
:class:`~packtune.errors.SpecError` where one of those would fail every trial of it (the
trial-time checks in the worker stay, for workloads that declare nothing).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from packtune.errors import SpecError
from packtune.space import Choice, Dimension

if TYPE_CHECKING:
    from packtune.spec import Objective, TrainingSettings
    from packtune.workloads.base import Workload

T = TypeVar("T")
#: the most combinations of the answer-changing dimensions' ends :func:`corners` tries
COMBINATIONS = 4096


def ends(dimension: Dimension) -> tuple[Any, ...]:
    """The values a dimension's extremes are: a choice's every value, a range's two ends."""
    if isinstance(dimension, Choice):
        return dimension.values
    return (dimension.low, dimension.high)


def corners(
    space: Mapping[str, Dimension], answer: Callable[[dict[str, Any]], T]
) -> list[tuple[dict[str, Any], T]]:
    """``answer`` at the space's corners, each with the values it was given of the
    dimensions that matter to it: the first end of every dimension, each dimension's ends
    in turn with the others there, and every combination of the ends of those that matter
    (up to :data:`COMBINATIONS`). Each configuration is one the space can draw; parameters
    it leaves out keep the workload's defaults. A dimension matters when one of its ends
    changes the answer, from the first ends or from the workload's defaults (a space's one
    ``task``: its only value)."""
    values = {name: ends(dimension) for name, dimension in space.items()}
    base = {name: options[0] for name, options in values.items()}
    first, default = answer(base), answer({})
    tried = [({**base, name: v}, answer({**base, name: v}))
             for name, options in values.items() for v in options]  # fmt: skip
    moving = [n for n in values
              if any(a != first for c, a in tried if c[n] != base[n])
              or any(answer({n: v}) != default for v in values[n])]  # fmt: skip
    if 1 < len(moving) and math.prod(len(values[n]) for n in moving) <= COMBINATIONS:
        for combo in itertools.product(*(values[n] for n in moving)):
            config = {**base, **dict(zip(moving, combo, strict=True))}
            tried.append((config, answer(config)))
    return [({n: c[n] for n in moving}, a) for c, a in [(base, first), *tried]]


def _asked(ask: Callable[[dict[str, Any]], T]) -> Callable[[dict[str, Any]], T | None]:
    """``ask``, with None (not declared) where it raises: a plugin's mistake in a
    declaration leaves its check to the worker, it does not fail the request."""

    def asked(config: dict[str, Any]) -> T | None:
        try:
            return ask(config)
        except Exception:
            return None

    return asked


def _at(values: Mapping[str, Any]) -> str:
    """Where in the space an answer was found, in words ("": anywhere)."""
    return "".join(f"{', ' if i else ' at '}{name}={value!r}" for i, (name, value)
                   in enumerate(values.items()))  # fmt: skip


def check_objective(
    workload: Workload, objective: Objective, space: Mapping[str, Dimension]
) -> None:
    """The objective's metric is one the workload reports (when it declares them), at every
    configuration of the space, ranked in the direction the workload declares for it."""
    reported = workload.reported_metrics()
    if reported is not None and objective.metric not in reported:
        raise SpecError(
            "objective.metric",
            f"workload {workload.name!r} does not report {objective.metric!r}; "
            f"it reports {sorted(reported)}",
        )
    for values, there in corners(space, _asked(workload.reported_metrics)):
        if there is not None and objective.metric not in there:
            raise SpecError(
                "objective.metric",
                f"{workload.name} reports {sorted(there)}{_at(values)}, not "
                f"{objective.metric!r}, which it reports only at other values of its parameters",
            )
    better = (reported or {}).get(objective.metric)
    if better is not None and objective.mode != better:
        higher = "higher" if better == "max" else "lower"
        raise SpecError(
            "objective.mode",
            f"{objective.metric} is better when {higher} ({workload.name!r} declares "
            f"{better!r}); mode {objective.mode!r} would rank the worst trial first",
        )


def check_decoupled(
    workload: Workload, training: TrainingSettings, space: Mapping[str, Dimension]
) -> None:
    """A decoupled study's trials can train decoupled: in-memory data and the plain step,
    class labels, and a model of at least ``segments`` layers with parameters, at every
    configuration of the space (as far as the workload declares them)."""
    if training.mode != "decoupled":
        return
    name = workload.name
    if workload.streams or workload.custom_step:
        way = "streams its batches" if workload.streams else "defines its own training_loss()"
        raise SpecError("training.mode", f"{name} {way}: decoupled training needs data() and "
                        "the plain step (loss(model(x), y)); use mode: end_to_end")  # fmt: skip
    for values, classes in corners(space, _asked(workload.class_targets)):
        if classes is False:
            raise SpecError(
                "training.mode",
                f"decoupled training draws a target vector per class: {name}'s targets are "
                f"not class labels{_at(values)}",
            )
    for values, most in corners(space, _asked(workload.max_segments)):
        if most is None or most >= training.segments:
            continue
        if most == 0:
            raise SpecError("training.mode", f"{name}'s model is not a plain nn.Sequential"
                            f"{_at(values)}: it cannot be cut into segments")  # fmt: skip
        s = "s" * (most != 1)
        raise SpecError(
            "training.segments",
            f"{name}'s model has {most} layer{s} with parameters{_at(values)}: it can be cut "
            f"into at most {most} segment{s}, not {training.segments}",
        )
