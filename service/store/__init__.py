"""Repository functions: every read and write the services make.

Callers use ``from service import store`` and ``store.<function>``; the functions
live in :mod:`.studies`, :mod:`.trials` (with measurements and promotions),
:mod:`.packs` and :mod:`.fleet` (workers, profiles, leases); :mod:`.transitions`
owns every status change (the allowed moves and the guarded writes), and
:mod:`._sql` holds what the two backends write differently.

Each function takes a :class:`~sqlalchemy.orm.Session` first, flushes but
never commits; the caller's :func:`service.db.session_scope` commits. Writes
that two processes may race on (adding trials, measurements, promotions,
claiming a pack, heartbeats, profiles, leases) are single conditional
statements -- ``INSERT ... ON CONFLICT`` or ``UPDATE ... WHERE <state>`` --
so they are idempotent and safe on SQLite and PostgreSQL alike.

Times are timezone-aware UTC from the application clock; hosts are expected to
keep their clocks in sync (NTP) for heartbeats and leases to mean the same
thing everywhere.
"""

from service.store._sql import id_in
from service.store.checks import (
    OPEN_CHECK,
    checks_with_status,
    create_check,
    finish_check,
    get_check,
    set_check_job,
    start_check,
)
from service.store.fleet import (
    THROUGHPUT_SMOOTHING,
    acquire_lease,
    get_profile,
    heartbeat,
    live_workers,
    mark_dead_workers,
    profiles_of,
    record_throughput,
    release_lease,
    set_memory_model,
    worker_names,
)
from service.store.packs import (
    CLAIMABLE_PACK,
    claim_pack,
    create_pack,
    finish_pack,
    fusion_keys_of_packs,
    get_pack,
    packs_of,
    packs_per_device,
    packs_with_status,
    queue_pack,
    requeue_pack,
    requeue_packs_of,
    retry_pack,
    unfinished_members,
)
from service.store.studies import (
    create_study,
    delete_study,
    get_study,
    list_studies,
    studies_with_status,
    studies_with_trials_in,
)
from service.store.transitions import (
    FINISHED_PACK,
    FINISHED_STUDY,
    PACK_FROM,
    STUDY_FROM,
    TRIAL_FROM,
    UPDATE_CHUNK,
    move_pack,
    move_study,
    move_study_packs,
    move_study_trials,
    move_trials,
    retry_study,
)
from service.store.trials import (
    TrialBrief,
    add_trials,
    brackets_summary,
    count_trials,
    count_trials_by_status,
    get_trial,
    latest_measurement,
    measurements_of,
    promotions_of,
    record_measurement,
    record_measurements,
    record_promotions,
    rung_counts,
    set_trials,
    trial_briefs,
    trials_by_id,
    trials_of,
    values_at,
)

__all__ = [
    "OPEN_CHECK",
    "checks_with_status",
    "create_check",
    "finish_check",
    "get_check",
    "set_check_job",
    "start_check",
    "requeue_pack",
    "retry_study",
    "retry_pack",
    "requeue_packs_of",
    "unfinished_members",
    "worker_names",
    "profiles_of",
    "fusion_keys_of_packs",
    "packs_per_device",
    "packs_with_status",
    "studies_with_status",
    "studies_with_trials_in",
    "values_at",
    "acquire_lease",
    "add_trials",
    "brackets_summary",
    "count_trials",
    "rung_counts",
    "claim_pack",
    "CLAIMABLE_PACK",
    "count_trials_by_status",
    "create_pack",
    "create_study",
    "delete_study",
    "finish_pack",
    "FINISHED_PACK",
    "FINISHED_STUDY",
    "get_pack",
    "get_profile",
    "get_study",
    "get_trial",
    "heartbeat",
    "id_in",
    "latest_measurement",
    "list_studies",
    "live_workers",
    "mark_dead_workers",
    "move_pack",
    "move_study",
    "move_study_packs",
    "move_study_trials",
    "move_trials",
    "PACK_FROM",
    "STUDY_FROM",
    "TRIAL_FROM",
    "measurements_of",
    "packs_of",
    "promotions_of",
    "queue_pack",
    "record_measurement",
    "record_measurements",
    "record_promotions",
    "record_throughput",
    "release_lease",
    "set_memory_model",
    "set_trials",
    "THROUGHPUT_SMOOTHING",
    "trial_briefs",
    "TrialBrief",
    "trials_by_id",
    "trials_of",
    "UPDATE_CHUNK",
]
