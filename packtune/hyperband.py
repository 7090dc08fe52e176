"""Hyperband's arithmetic (Li et al., JMLR 2018), exactly, and rung promotion.

Paper symbols and their names here:

==========  ======================  =============================================
paper       code                    meaning
==========  ======================  =============================================
R           ``max_resource``        resource of the last rung (epochs by default)
r_min       ``min_resource``        smallest resource a rung may have
eta         ``eta``                 keep 1/eta of a rung; resources grow by eta
s_max       :func:`s_max`           largest s with ``eta**s <= R / r_min``
s           ``s``                   a bracket; bracket index ``j`` has ``s_max - j``
n           ``Rung.n`` of rung 0    ``ceil((s_max + 1) * eta**s / (s + 1))``
r           ``Rung.resource`` of 0  ``R * eta**(-s)``
n_i         ``Rung.n`` of rung i    ``floor(n / eta**i)``
r_i         ``Rung.resource``       ``r * eta**i``: cumulative resource at rung i
==========  ======================  =============================================

Everything that decides a count is integer (or :class:`fractions.Fraction`)
arithmetic: ``floor(log(243, 3))`` is 4 in floating point, not 5. A float
resource is taken as the decimal it prints as (``0.1`` is exactly 1/10), so
``max_resource=0.9, min_resource=0.1, eta=3`` has ``s_max`` 2. Rung
resources are computed as ``R / eta**(s - i)`` from the exact value, so the
last rung of every bracket is exactly ``max_resource``.

Promotion (:func:`promote`) keeps the best ``floor(n_i / eta)`` of a finished
rung. Ties break by trial id; a trial without a finite metric (``None``, NaN,
±inf: it diverged or failed) ranks after every finite one and is never
promoted, even if that leaves the next rung short.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

Direction = Literal["min", "max"]


@dataclass(frozen=True)
class Rung:
    """``n`` trials trained to cumulative resource ``resource``."""

    n: int
    resource: float


def _check(max_resource: float, eta: int, min_resource: float) -> tuple[Fraction, Fraction]:
    if isinstance(eta, bool) or not isinstance(eta, int) or eta < 2:
        raise ValueError(f"eta must be an integer >= 2, got {eta!r}")
    exact: list[Fraction] = []
    for name, value in (("min_resource", min_resource), ("max_resource", max_resource)):
        if isinstance(value, bool) or not isinstance(value, int | float | Fraction):
            raise ValueError(f"{name} must be a number, got {value!r}")
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be finite and > 0, got {value!r}")
        # A float is read as the decimal it prints as (0.1 -> 1/10), the number the
        # user typed, so that 9 * 0.1 <= 0.9 holds as the user expects.
        exact.append(Fraction(repr(value)) if isinstance(value, float) else Fraction(value))
    low, high = exact
    if high < low:
        raise ValueError(f"max_resource ({max_resource}) must be >= min_resource ({min_resource})")
    return high, low


def s_max(max_resource: float, eta: int = 3, min_resource: float = 1) -> int:
    """The largest integer ``s`` with ``eta**s * min_resource <= max_resource``."""
    high, low = _check(max_resource, eta, min_resource)
    s = 0
    while eta ** (s + 1) * low <= high:
        s += 1
    return s


def plan_brackets(max_resource: float, eta: int = 3, min_resource: float = 1) -> list[list[Rung]]:
    """Every bracket's rungs, highest ``s`` first (bracket index ``j`` has ``s = s_max - j``)."""
    high, _ = _check(max_resource, eta, min_resource)
    top = s_max(max_resource, eta, min_resource)
    brackets = []
    for s in range(top, -1, -1):
        n = -(-(top + 1) * eta**s // (s + 1))  # ceil, in integers
        brackets.append([Rung(n // eta**i, float(high / eta ** (s - i))) for i in range(s + 1)])
    return brackets


def bracket_s(brackets: Sequence[Sequence[Rung]], index: int) -> int:
    """The paper's ``s`` of bracket ``index`` in :func:`plan_brackets`' order."""
    if not 0 <= index < len(brackets):
        raise IndexError(f"no bracket {index} among {len(brackets)}")
    return len(brackets) - 1 - index


def total_trials(brackets: Sequence[Sequence[Rung]]) -> int:
    """Trials a study samples: the sum of every bracket's first-rung ``n``."""
    return sum(bracket[0].n for bracket in brackets)


def total_units(brackets: Sequence[Sequence[Rung]]) -> int:
    """Units of work if every rung fills: one per trial per rung."""
    return sum(rung.n for bracket in brackets for rung in bracket)


def rung_resources(brackets: Sequence[Sequence[Rung]]) -> tuple[float, ...]:
    """Every distinct rung resource of a study, ascending: where some bracket decides.

    Every bracket's rungs lie on the one grid ``R / eta**k``, so a trial training toward
    its rung passes the rungs of the other brackets on its way.
    """
    return tuple(sorted({rung.resource for bracket in brackets for rung in bracket}))


def next_stop(stops: Sequence[float], done: float, target: float) -> float:
    """The end of the next segment of a unit from ``done`` to ``target``, when units are cut
    at ``stops`` (see :func:`rung_resources`): the first stop beyond ``done``, at most
    ``target``. Cut so, units of different brackets share their spans and can be fused."""
    if target <= done:
        raise ValueError(f"nothing to train: target {target} <= done {done}")
    for stop in stops:
        if stop > done and not math.isclose(stop, done, rel_tol=1e-9, abs_tol=1e-12):
            return min(stop, target)
    return target


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def rank(results: Sequence[tuple[int, float | None]], mode: Direction) -> list[int]:
    """Trial ids best first; ties by id; ``None``/NaN/inf last, by id."""
    if mode not in ("min", "max"):
        raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
    ids = [trial_id for trial_id, _ in results]
    if len(set(ids)) != len(ids):
        raise ValueError("results name a trial id more than once")
    sign = 1.0 if mode == "min" else -1.0
    finite = sorted(
        (sign * value, trial_id)
        for trial_id, value in results
        if value is not None and math.isfinite(value)
    )
    rest = sorted(trial_id for trial_id, value in results if not _finite(value))
    return [trial_id for _, trial_id in finite] + rest


def promote(
    results: Sequence[tuple[int, float | None]],
    eta: int,
    mode: Direction,
    *,
    planned: int | None = None,
) -> list[int]:
    """The ids to promote from a finished rung: its best ``floor(n_i / eta)``, finite only.

    ``planned``: the rung's size ``n_i`` in the bracket's plan (default: ``len(results)``).
    A rung left short because an earlier rung had too few finite results (diverged or
    failed trials are never promoted) still keeps the plan's ``floor(n_i / eta)``, as many
    as it has: judged by its own size, 2 trials of a planned 3 at eta 3 would keep none,
    and the bracket would end with no trial at its largest resource."""
    if isinstance(eta, bool) or not isinstance(eta, int) or eta < 2:
        raise ValueError(f"eta must be an integer >= 2, got {eta!r}")
    keep = (len(results) if planned is None else planned) // eta
    finite = sum(1 for _, value in results if _finite(value))
    return rank(results, mode)[: min(keep, finite)]
