"""The read side: what the API and the dashboard show, as plain dicts.

Callers use ``from service import queries`` and ``queries.<function>``; the
functions live in :mod:`.studies`, :mod:`.trials` and :mod:`.runs` (brackets,
packs, workers, workloads, measured array sizes).

ORM rows never leave this module. Every function costs a fixed number of
queries whatever the study's size (no query per trial): a trial's latest
metrics come from one join against each trial's largest measured resource.

Progress counts *rung-units*, one per trial per rung that Hyperband would run
if every rung filled (``total_units`` of the spec's plan). A trial at rung
``i`` has finished ``i`` units, plus the one at rung ``i`` if it is paused,
stopped, completed, diverged or failed there (a diverged or failed trial's
unit is finished though it gave no usable metric; a cancelled one's is not).
Rungs can fill short of plan (trials that diverge are never promoted), so a
completed study reports ``done = total`` rather than leave its bar unfilled.
"""

from service.queries.rows import Row
from service.queries.runs import (
    brackets,
    packs,
    profiles,
    workers,
    workloads,
)
from service.queries.studies import (
    list_studies,
    study_summary,
)
from service.queries.trials import (
    curves,
    leaderboard,
    trials,
)

__all__ = [
    "brackets",
    "curves",
    "leaderboard",
    "list_studies",
    "packs",
    "profiles",
    "Row",
    "study_summary",
    "trials",
    "workers",
    "workloads",
]
