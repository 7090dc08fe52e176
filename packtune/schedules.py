"""Learning-rate schedules: the factor a trial's ``lr`` is multiplied by at each step.

Pure arithmetic on Python floats (no torch), so that the API can validate a schedule and
the fused optimizer can compute every member's learning rate from its own step count.
A schedule is a function of the optimizer step alone -- never of the epoch a pack started
at -- so a trial paused at a rung and resumed in another pack, beside other trials at
other steps, continues its schedule exactly.

Kinds (the ``schedule`` parameter):

- ``constant``: ``1``;
- ``step``: ``gamma ** floor(t / decay_steps)``, ``decay_steps`` from ``decay_epochs``;
- ``cosine``: from ``1`` down to ``final_lr_ratio`` along half a cosine, over the study's
  ``max_resource`` epochs (the horizon every trial shares: Hyperband does not know in
  advance how far a trial will be promoted, so the horizon is the farthest it can go);
- any kind with ``warmup_epochs > 0`` first rises linearly over that many epochs
  (``(t + 1) / warmup_steps``), then follows the kind over the remaining steps: linear
  warm-up then cosine is ``schedule: cosine`` with ``warmup_epochs``.

``t`` counts the optimizer steps taken before this one (0 for the first), as
``torch.optim.lr_scheduler.LambdaLR`` counts them when stepped once per optimizer step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SCHEDULES = ("constant", "step", "cosine")

#: a schedule's parameters and their defaults (shared by every built-in workload)
SCHEDULE_PARAMS: dict[str, Any] = {
    "schedule": "constant",
    "warmup_epochs": 0.0,
    "decay_epochs": 10.0,
    "gamma": 0.1,
    "final_lr_ratio": 0.0,
}


@dataclass(frozen=True)
class Schedule:
    """One trial's schedule, in optimizer steps."""

    kind: str = "constant"
    warmup_steps: int = 0
    decay_steps: int = 1
    gamma: float = 0.1
    final_ratio: float = 0.0
    total_steps: int = 1

    @property
    def constant(self) -> bool:
        return self.kind == "constant" and self.warmup_steps == 0

    def factor(self, t: int) -> float:
        """The multiplier of the base ``lr`` for the step after ``t`` steps."""
        if t < self.warmup_steps:
            return (t + 1) / self.warmup_steps
        u = t - self.warmup_steps
        if self.kind == "step":
            return self.gamma ** (u // self.decay_steps)
        if self.kind == "cosine":
            span = max(1, self.total_steps - self.warmup_steps)
            cos = 0.5 * (1 + math.cos(math.pi * min(u, span) / span))
            return self.final_ratio + (1 - self.final_ratio) * cos
        return 1.0


def schedule_of(config: Mapping[str, Any], steps_per_epoch: int, max_epochs: float) -> Schedule:
    """The schedule a resolved ``config`` asks for, ``max_epochs`` being the study's
    ``max_resource``. Raises ``ValueError`` naming the parameter for a value out of range."""
    p = {**SCHEDULE_PARAMS, **{k: v for k, v in config.items() if k in SCHEDULE_PARAMS}}
    check_schedule(p)
    return Schedule(
        kind=str(p["schedule"]),
        warmup_steps=round(float(p["warmup_epochs"]) * steps_per_epoch),
        decay_steps=max(1, round(float(p["decay_epochs"]) * steps_per_epoch)),
        gamma=float(p["gamma"]),
        final_ratio=float(p["final_lr_ratio"]),
        total_steps=max(1, round(max_epochs * steps_per_epoch)),
    )


def check_schedule(params: Mapping[str, Any]) -> None:
    """``ValueError`` naming the first schedule parameter of ``params`` out of range."""
    kind = params.get("schedule", "constant")
    if kind not in SCHEDULES:
        raise ValueError(f"schedule: {kind!r} is not one of {', '.join(SCHEDULES)}")
    for name, low, high in LIMITS:
        if name in params and not low <= float(params[name]) <= high:
            raise ValueError(f"{name}: {params[name]!r} is outside {low:g} to {high:g}")


#: (parameter, low, high): what each schedule parameter may be
LIMITS = (
    ("warmup_epochs", 0.0, 1e6),
    ("decay_epochs", 1e-9, 1e6),
    ("gamma", 0.0, 1.0),
    ("final_lr_ratio", 0.0, 1.0),
)
