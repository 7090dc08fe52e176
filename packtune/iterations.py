"""A study's brackets across repeated Hyperband iterations, and when each may be sampled.

A study runs Hyperband's outer loop ``budget.iterations()`` times. Its brackets form one
sequence, iteration by iteration, highest ``s`` first (:class:`Slot`); the ``g``-th
bracket's trials have the sample indices after those of every earlier bracket, so a
trial's index, and with it its random draws, never depends on timing.

**Waves** (model-based sampling). A bracket drawn from a model should see results; packs
want many ready trials. The rule here: bracket ``g > 0`` is sampled once every earlier
bracket has *settled* every rung whose resource is at most :func:`cutoff` ``(g)`` -- the
first rung resource of bracket ``g - 1``, capped at the study's lowest rung resource
(:data:`~packtune.tuning.WAIT_RUNGS`), or the largest rung resource below
``max_resource`` when that is all there is. Its model then sees exactly the results of
those rungs: the same set whatever the packing, the number of workers, or a scheduler
restart, because a settled rung never changes. Within one iteration, the later brackets
therefore all start together once the aggressive bracket's first rung is settled (one
epoch in, for R=27), so that their long chains of rungs overlap instead of queueing
behind each other; the aggressive bracket itself is drawn in waves (the caller's
``wave_size``). The next iteration's first bracket also waits until every trial of the
previous iteration has started training, so that sampling never runs ahead of training.

The ``random`` sampler needs no results: an iteration's brackets start together (as a
single Hyperband iteration always did), and the next iteration once every trial of the
previous one has started training.

With ``scheduler: asha`` an iteration is one batch of as many trials as a Hyperband
iteration samples, all on the ladder of Hyperband's most aggressive bracket
(:func:`asha_slots`, :func:`asha_ladder`); a batch learns from the first rung of the
batches before it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from packtune.hyperband import Rung, total_trials, total_units
from packtune.tuning import WAIT_RUNGS


@dataclass(frozen=True)
class Slot:
    """The ``g``-th bracket of a study: bracket ``s`` of iteration ``iteration``, whose
    ``n`` trials take the sample indices ``first, first + 1, ...``."""

    g: int
    iteration: int
    s: int
    n: int
    first: int

    @property
    def indices(self) -> range:
        return range(self.first, self.first + self.n)


def slots(
    brackets: Sequence[Sequence[Rung]], iterations: int, max_trials: int | None = None
) -> Iterator[Slot]:
    """Every bracket of a study in order: ``iterations`` times the Hyperband plan
    ``brackets`` (highest ``s`` first), stopping before the first bracket whose trials
    would not all fit in ``max_trials``."""
    s_max = len(brackets) - 1
    g = first = 0
    for iteration in range(iterations):
        for j, rungs in enumerate(brackets):
            n = rungs[0].n
            if max_trials is not None and first + n > max_trials:
                return
            yield Slot(g=g, iteration=iteration, s=s_max - j, n=n, first=first)
            g += 1
            first += n


def first_rung(brackets: Sequence[Sequence[Rung]], s: int) -> float:
    """The resource of bracket ``s``'s first rung."""
    return float(brackets[len(brackets) - 1 - s][0].resource)


def cutoff(brackets: Sequence[Sequence[Rung]], previous_s: int) -> float:
    """The largest rung resource whose results a bracket sampled after bracket
    ``previous_s`` waits for (see the module docstring): that bracket's first rung, but no
    higher than the study's rung resource of index ``WAIT_RUNGS`` (the largest rung
    resource below ``max_resource`` when that is all there is)."""
    grid = sorted({float(r.resource) for b in brackets for r in b})
    top = grid[-1]  # max_resource: bracket s=0 has one rung
    resource = min(first_rung(brackets, previous_s), grid[min(WAIT_RUNGS, len(grid) - 1)])
    if resource < top:
        return resource
    below = [r for r in grid if r < top]
    return below[-1] if below else top


def rungs_upto(brackets: Sequence[Sequence[Rung]], s: int, resource: float) -> list[int]:
    """The rungs of bracket ``s`` whose resource is at most ``resource``."""
    rungs = brackets[len(brackets) - 1 - s]
    return [i for i, r in enumerate(rungs) if float(r.resource) <= resource * (1 + 1e-12)]


def asha_slots(
    brackets: Sequence[Sequence[Rung]], iterations: int, max_trials: int | None = None
) -> Iterator[Slot]:
    """ASHA's batches: per iteration, :func:`~packtune.hyperband.total_trials` trials on
    the ladder of bracket ``s_max`` (the last batch cut to what ``max_trials`` leaves)."""
    s_max = len(brackets) - 1
    per = total_trials(brackets)
    first = 0
    for iteration in range(iterations):
        n = per if max_trials is None else min(per, max_trials - first)
        if n <= 0:
            return
        yield Slot(g=iteration, iteration=iteration, s=s_max, n=n, first=first)
        first += n


def asha_ladder(brackets: Sequence[Sequence[Rung]], eta: int, n: int) -> list[Rung]:
    """The rungs ``n`` trials climb under ASHA: bracket ``s_max``'s resources, with the
    ``floor(n / eta**i)`` trials that synchronous halving would keep (ASHA may keep more)."""
    return [Rung(n // eta**i, rung.resource) for i, rung in enumerate(brackets[0])]


def planned_units(
    brackets: Sequence[Sequence[Rung]],
    eta: int,
    asha: bool,
    iterations: int,
    max_trials: int | None = None,
) -> int:
    """The units of work (a trial trained to a rung) in ``iterations`` iterations of the
    plan ``brackets``, as :func:`slots` (Hyperband) or :func:`asha_slots` start them within
    ``max_trials``; ASHA's per batch as synchronous halving would keep (it may keep more).
    Counted per whole iteration, then the last one's brackets: no walk over every slot."""
    per = total_trials(brackets)

    def batch(n: int) -> int:
        return sum(rung.n for rung in asha_ladder(brackets, eta, n))

    whole = iterations if max_trials is None else min(iterations, max_trials // per)
    total = whole * (batch(per) if asha else total_units(brackets))
    left = 0 if max_trials is None or whole >= iterations else max_trials - whole * per
    if asha and left > 0:
        return total + batch(left)
    for rungs in brackets if left > 0 else ():
        if rungs[0].n > left:  # a bracket starts only when all of its trials fit
            break
        total += sum(rung.n for rung in rungs)
        left -= rungs[0].n
    return total
