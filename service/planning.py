"""Turn a study's ready trials into packs: the adapter between the store and ``packing``.

Reads pending trials, live workers and profiles; calls the pure planner; writes
the packs (status ``pending``) and marks their trials ``queued``, all in the
caller's transaction.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from packtune.packing import (
    Device,
    MemoryModel,
    PackPlan,
    Unit,
    best_array_size,
    plan_packs,
)
from packtune.rungs import rung_resource, unit_end
from packtune.settings import Settings
from packtune.spec import StoredSpec
from packtune.tuning import (
    DEFAULT_BASE_BYTES,
    DEFAULT_PER_TRIAL_BYTES,
    MAX_UNITS_PER_PLAN,
    PROBE_UNITS,
    QUEUE_DEPTH,
)
from service import store
from service.models import PackStatus, Profile, Study, TrialStatus, Worker

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

DEFAULT_MEMORY = MemoryModel(base=DEFAULT_BASE_BYTES, per_trial=DEFAULT_PER_TRIAL_BYTES)
UNFINISHED = (PackStatus.pending, PackStatus.queued, PackStatus.running)


def devices_of(workers: list[Worker], settings: Settings) -> dict[str, tuple[Device, str]]:
    """Every device of the live workers: name -> (Device, device kind)."""
    out: dict[str, tuple[Device, str]] = {}
    for w in workers:
        if w.gpus:
            for g in w.gpus:
                free = int(g.get("memory_available", g.get("memory_free", 0)))
                name = f"{w.name}/cuda:{g.get('index', 0)}"
                out[name] = (Device(name, free), w.device_kind)
        else:
            budget = w.memory_budget or settings.cpu_memory_budget
            out[f"{w.name}/cpu"] = (Device(f"{w.name}/cpu", budget), w.device_kind)
    return out


def _probe_first(
    units: list[Unit], profiles: dict[str, Profile], in_flight: set[str]
) -> list[Unit]:
    """Of a fusion key never run on this device kind, plan only its :data:`PROBE_UNITS`
    shortest units, and none while a pack of that key is still out: that pack's job probes
    the key's memory and throughput, and the rest waits to be planned with the measured
    array sizes (arrays of the unmeasured default, 2, would otherwise take a whole rung,
    long units included)."""
    measured = {key for key, p in profiles.items() if p.throughput}
    out, kept = [], Counter[str]()
    ordered = sorted(units, key=lambda u: (u.to_resource - u.from_resource, u.trial_id))
    for u in ordered:
        if u.fusion_key not in measured and u.fusion_key in in_flight:
            continue
        if u.fusion_key in measured or kept[u.fusion_key] < PROBE_UNITS:
            kept[u.fusion_key] += 1
            out.append(u)
    return out


def plan_study(
    s: Session, study: Study, workers: list[Worker], settings: Settings
) -> PackPlan | None:
    """Plan and record packs for the study's pending trials; None when nothing could run."""
    pending = store.trial_briefs(s, study.id, status=TrialStatus.pending)
    if not pending:
        return None
    devices = devices_of(workers, settings)
    busy = store.packs_per_device(s, UNFINISHED)
    free = [dev for name, (dev, _) in devices.items() if busy[name] < QUEUE_DEPTH]
    if not free:
        return None
    kind = devices[free[0].name][1]  # one device kind per plan; mixed fleets use the first
    spec = StoredSpec.of(study.spec)
    cap = spec.packing.max_pack_size if spec.packing.enabled else 1
    profiles = store.profiles_of(s, study.workload, kind)
    units = []
    for t in pending:
        target = rung_resource(spec, t.bracket, t.rung)
        end = unit_end(spec, t.resource_done, target)
        units.append(Unit(t.id, t.fusion_key, t.resource_done, end))
    units = _probe_first(units, profiles, store.fusion_keys_of_packs(s, study.id, UNFINISHED))
    # bounded work per tick: the rest is planned by the next tick, which the loop runs at
    # once (a tick that plans packs is followed by another without waiting)
    units.sort(key=lambda u: (*u.group, u.trial_id))
    units, later = units[:MAX_UNITS_PER_PLAN], units[MAX_UNITS_PER_PLAN:]
    memory: dict[str, MemoryModel] = {}
    sizes: dict[str, int] = {}
    for key in {u.fusion_key for u in units}:
        p = profiles.get(key)
        if p is not None and p.base_bytes is not None and p.per_trial_bytes is not None:
            memory[key] = MemoryModel(int(p.base_bytes), int(p.per_trial_bytes))
        table = {int(k): float(v) for k, v in (p.throughput if p else {}).items()}
        sizes[key] = best_array_size(table, cap)
    plan = plan_packs(
        units,
        free,
        memory,
        sizes,
        default_memory=DEFAULT_MEMORY,
        max_pack_size=cap,
        max_packs_per_device=1,
    )
    plan.deferred += later
    queued: list[int] = []
    for planned in plan.packs:
        members = [
            (u.trial_id, u.fusion_key, u.from_resource, u.to_resource) for u in planned.units
        ]
        store.create_pack(
            s,
            study_id=study.id,
            members=members,
            device=planned.device,
            estimated_bytes=planned.estimated_bytes,
        )
        queued += [u.trial_id for u in planned.units]
    store.move_trials(s, queued, TrialStatus.queued, only_from=(TrialStatus.pending,))
    store.move_trials(
        s,
        [u.trial_id for u in plan.unplaceable],
        TrialStatus.failed,
        only_from=(TrialStatus.pending,),
        error="fits no device: its estimated memory exceeds every live device's free memory",
    )
    s.flush()
    return plan
