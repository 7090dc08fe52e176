"""Where a study's configurations come from: at random, or from a model of the results so far.

``random`` draws every trial's config from its own seeded stream
(:func:`~packtune.space.sample_config`). ``tpe`` is BOHB's idea (Falkner et al., ICML
2018) on Optuna's Tree-structured Parzen Estimator: a density-ratio model fitted to the
results measured at the largest rung resource with enough observations, from which a
batch of configurations is drawn at once (Optuna's "constant liar" spreads a batch drawn
before any of it is measured). A fraction of draws stays random, for exploration, and so
does every draw while too few results exist.

Optuna is used through its ask-and-tell interface over an in-memory study that holds only
what the caller passes in, so a draw is a pure function of (space, observations, seed,
sample indices): the same inputs give the same configs on any machine, packed or not,
after any restart. The caller decides *which* observations exist at the moment a bracket
is drawn (service.lifecycle: only rungs that are decided, in a fixed order).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from packtune.space import Choice, Dimension, Int, LogUniform, Uniform, sample_config, seeded_rng

SamplerName = Literal["tpe", "random"]

#: the share of random draws among model-based ones: BOHB's 1/3 ended worse on bench f
#: (digits-mlp, 10 seeds, median best val_loss: 1/3 0.1031, 0.2 0.0991, 0.1 0.0990)
RANDOM_FRACTION = 0.2


@dataclass(frozen=True)
class Observation:
    """A configuration's objective ``value`` measured at ``resource`` (``None``: it
    diverged or failed there, and ranks after every finite value)."""

    config: Mapping[str, Any]
    resource: float
    value: float | None


def min_points(space: Mapping[str, Dimension]) -> int:
    """Observations a model needs at one resource: BOHB's ``d + 2`` over ``N_min = d + 1``."""
    return len(space) + 3


def model_budget(observations: Sequence[Observation], needed: int) -> float | None:
    """The largest resource with at least ``needed`` observations (finite or not); None if
    no resource has enough."""
    counts: dict[float, int] = {}
    for o in observations:
        counts[o.resource] = counts.get(o.resource, 0) + 1
    enough = [r for r, n in counts.items() if n >= needed]
    return max(enough) if enough else None


def _distributions(space: Mapping[str, Dimension]) -> dict[str, Any]:
    from optuna.distributions import (
        CategoricalDistribution,
        FloatDistribution,
        IntDistribution,
    )

    out: dict[str, Any] = {}
    for name in sorted(space):
        d = space[name]
        if isinstance(d, Uniform):
            out[name] = FloatDistribution(d.low, d.high)
        elif isinstance(d, LogUniform):
            out[name] = FloatDistribution(d.low, d.high, log=True)
        elif isinstance(d, Int):
            out[name] = IntDistribution(d.low, d.high, log=d.log)
        elif isinstance(d, Choice):
            out[name] = CategoricalDistribution(d.values)
        else:  # pragma: no cover - Dimension is a closed union
            raise TypeError(f"no distribution for {d!r}")
    return out


def _known(config: Mapping[str, Any], space: Mapping[str, Dimension]) -> bool:
    """The config lies in ``space`` (an observation from an older space is left out)."""
    for name, d in space.items():
        if name not in config:
            return False
        v = config[name]
        if isinstance(d, Choice):
            if v not in d.values:
                return False
        elif isinstance(v, bool) or not isinstance(v, int | float) or not d.low <= v <= d.high:
            return False
    return True


def _seed(seed: int, label: str) -> int:
    return seeded_rng(f"{seed}:{label}").getrandbits(32)


def explores(seed: int, index: int, random_fraction: float) -> bool:
    """Whether trial ``index`` is drawn at random although a model exists."""
    return seeded_rng(f"{seed}:{index}:explore").random() < random_fraction


def suggest(
    space: Mapping[str, Dimension],
    observations: Sequence[Observation],
    *,
    seed: int,
    indices: Sequence[int],
    mode: Literal["min", "max"] = "min",
    sampler: SamplerName = "tpe",
    random_fraction: float = RANDOM_FRACTION,
) -> list[dict[str, Any]]:
    """The configs of the trials ``indices`` (one bracket, drawn together).

    Random draws (``sampler="random"``, the exploration share, or too few observations
    at every resource) are exactly :func:`~packtune.space.sample_config`'s, so a study's
    first bracket is the same under either sampler.
    """
    configs: dict[int, dict[str, Any]] = {}
    budget = None
    usable: list[Observation] = []
    if sampler == "tpe" and space:
        usable = [o for o in observations if _known(o.config, space)]
        budget = model_budget(usable, min_points(space))
    modelled = [i for i in indices if budget is not None and not explores(seed, i, random_fraction)]
    for i in indices:
        if i not in modelled:
            configs[i] = sample_config(space, seed, i)
    if modelled:
        at = [o for o in usable if o.resource == budget]
        drawn = _tpe(space, at, seed=_seed(seed, f"tpe:{modelled[0]}"), n=len(modelled), mode=mode)
        configs.update(zip(modelled, drawn, strict=True))
    return [configs[i] for i in indices]


def _tpe(
    space: Mapping[str, Dimension],
    observations: Sequence[Observation],
    *,
    seed: int,
    n: int,
    mode: Literal["min", "max"],
) -> list[dict[str, Any]]:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    distributions = _distributions(space)
    finite = [o.value for o in observations if o.value is not None and math.isfinite(o.value)]
    worst = (max(finite) if mode == "min" else min(finite)) if finite else 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        tpe = optuna.samplers.TPESampler(
            seed=seed,
            n_startup_trials=0,
            multivariate=True,
            constant_liar=True,
        )
        study = optuna.create_study(
            direction="minimize" if mode == "min" else "maximize", sampler=tpe
        )
        for o in observations:
            value = o.value if o.value is not None and math.isfinite(o.value) else worst
            params = {name: o.config[name] for name in distributions}
            study.add_trial(
                optuna.trial.create_trial(
                    params=params, distributions=distributions, value=float(value)
                )
            )
        drawn = []
        for _ in range(n):  # asked, never told: the constant liar spreads the batch
            trial = study.ask(distributions)
            drawn.append({name: _plain(trial.params[name]) for name in distributions})
    return drawn


def _plain(value: Any) -> Any:
    """A JSON scalar (numpy scalars come back from some distributions)."""
    item = getattr(value, "item", None)
    return item() if callable(item) else value
