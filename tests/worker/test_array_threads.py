"""A pack's arrays trained at once, each in a thread: the same results as one after another.

A pack holds one fused array per fusion key and resource span. ``run_pack`` may
train several at once (``PACKTUNE_ARRAY_THREADS``); nothing a trial records may
depend on it: not its initial weights (members are seeded through torch's
global generator), not a stochastic array's dropout masks (reseeded every
step), not its metrics. Real training on the CPU, real SQLite databases.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.nn import functional as F

from packtune.settings import get_settings
from packtune.space import fusion_key
from packtune.workloads import get_workload, registry
from service import store
from service.db import dispose_engines, get_sessionmaker, session_scope, upgrade
from service.models import PackStatus, TrialStatus
from worker import execute, jobs
from worker.workloads.digits import DigitsMLP

SPEC: dict[str, Any] = {
    "name": "threads",
    "workload": "digits-mlp",
    "objective": {"metric": "val_loss", "mode": "min"},
    "space": {},
    "hyperband": {"max_resource": 3, "min_resource": 1, "eta": 3},
    "packing": {"enabled": True, "max_pack_size": None},
    "seed": 5,
}
# four fusion keys (hidden and dropout are structural), two with dropout: stochastic arrays
CONFIGS = [
    {"hidden": h, "dropout": d, "lr": lr}
    for h, d in ((16, 0.0), (24, 0.3), (32, 0.0), (40, 0.2))
    for lr in (0.05, 0.2)
]


def fresh_database(
    env: pytest.MonkeyPatch, folder: Path, threads: int, device: str = "cpu"
) -> None:
    folder.mkdir()
    url = f"sqlite:///{folder / 'packtune.db'}"
    env.setenv("PACKTUNE_DATABASE_URL", url)
    env.setenv("PACKTUNE_CHECKPOINT_DIR", str(folder / "ckpt"))
    env.setenv("PACKTUNE_ARRAY_THREADS", str(threads))
    env.setenv("PACKTUNE_DEVICE", device)
    get_settings.cache_clear()
    dispose_engines()
    upgrade(url)


def make_pack(
    profiled: bool = True, kind: str = "cpu", configs: list[dict[str, Any]] = CONFIGS
) -> tuple[int, list[int]]:
    """One pack of ``configs``' trials (8 in 4 arrays), epochs 0 to 2; every key's memory
    measured."""
    workload = get_workload("digits-mlp")
    with session_scope(get_sessionmaker()) as s:
        study = store.create_study(s, name="threads", workload="digits-mlp", spec=SPEC, seed=5)
        rows = [
            {"sample_index": i, "bracket": 1, "rung": 0, "config": cfg,
             "fusion_key": fusion_key("digits-mlp", workload.resolve(cfg),
                                      workload.structural_params())}
            for i, cfg in enumerate(configs)
        ]  # fmt: skip
        store.add_trials(s, study.id, rows)
        trials = store.trials_of(s, study.id)
        for t in trials:
            t.status = TrialStatus.queued
        if profiled:
            for key in {t.fusion_key for t in trials}:
                store.set_memory_model(s, "digits-mlp", key, kind, 2**20, 2**20)
        pack = store.create_pack(
            s, study_id=study.id, members=[(t.id, t.fusion_key, 0.0, 2.0) for t in trials]
        )
        pack.status = PackStatus.queued
        return pack.id, [t.id for t in trials]


def curves() -> dict[str, Any]:
    """Each measured fusion key's (alone, at once) curves, "no reading" for neither."""
    with session_scope(get_sessionmaker()) as s:
        out: dict[str, Any] = {}
        for key in {t.fusion_key for t in store.trials_of(s, 1)}:
            measured = store.measured_curve(store.get_profile(s, "digits-mlp", key, "cpu"))
            out[key] = measured if measured != ({}, {}) else "no reading"
        return out


def outcome(trial_ids: list[int]) -> dict[int, Any]:
    with session_scope(get_sessionmaker()) as s:
        out = {}
        for tid in trial_ids:
            t = store.get_trial(s, tid)
            points = [(m.resource, m.metrics) for m in store.measurements_of(s, tid)]
            out[tid] = (t.status, t.resource_done, t.objective, points)
        return out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_arrays_at_once_record_exactly_what_one_after_another_records(
    embedded_db: pytest.MonkeyPatch, tmp_path: Path, device: str
) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    kind = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    spans: list[tuple[str, float, float]] = []
    real = execute.run_array

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        runs = real(*args, **kwargs)
        spans.append((threading.current_thread().name, start, time.perf_counter()))
        return runs

    embedded_db.setattr(jobs, "run_array", timed)
    results = {}
    for threads in (1, 4):
        fresh_database(embedded_db, tmp_path / f"threads{threads}", threads, device)
        spans.clear()
        pack_id, ids = make_pack(kind=kind)
        assert jobs.run_pack(pack_id) == "completed"
        results[threads] = outcome(ids)
        with session_scope(get_sessionmaker()) as s:
            assert store.get_pack(s, pack_id).status == PackStatus.completed
        names = {name for name, _, _ in spans}
        if threads == 1:
            assert names == {threading.current_thread().name}
        else:
            assert len(spans) == 4 and all(n.startswith("packtune-array") for n in names)
            first_end = min(end for _, _, end in spans)
            assert sum(start < first_end for _, start, _ in spans) >= 2  # they overlapped
        # four keys at once: no key's speed is its own (alone) or an at-once reading of it
        measured = curves()
        if threads == 1:
            assert all(list(alone) == [2] and at_once == {} for alone, at_once in measured.values())
        else:
            assert list(measured.values()) == ["no reading"] * 4, measured
    one, four = results[1], results[4]
    assert all(done == 2.0 and len(points) == 2 for _, done, _, points in one.values())
    assert four == one


def test_on_a_cpu_one_large_array_trains_as_halves_in_threads_with_the_same_results(
    embedded_db: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A pack of one array of 2 * CPU_SPLIT_MIN trials, with two array threads: two arrays of
    half as many, at once (a CPU step costs about k times one trial's); what each trial
    records is what the one array of all of them records."""
    configs = [{"hidden": 16, "lr": 0.01 + 0.01 * i} for i in range(2 * jobs.CPU_SPLIT_MIN)]
    runs: list[tuple[str, int, float, float]] = []
    real = execute.run_array

    def timed(job: execute.ArrayJob, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = real(job, *args, **kwargs)
        runs.append((threading.current_thread().name, len(job.members), start,
                     time.perf_counter()))  # fmt: skip
        return out

    embedded_db.setattr(jobs, "run_array", timed)
    results = {}
    for threads in (1, 2):
        fresh_database(embedded_db, tmp_path / f"threads{threads}", threads)
        runs.clear()
        pack_id, ids = make_pack(configs=configs)
        assert jobs.run_pack(pack_id) == "completed"
        results[threads] = outcome(ids)
        if threads == 1:
            assert [n for _, n, _, _ in runs] == [len(configs)]
        else:
            assert sorted(n for _, n, _, _ in runs) == [jobs.CPU_SPLIT_MIN] * 2, runs
            assert all(name.startswith("packtune-array") for name, _, _, _ in runs)
            assert max(start for *_, start, _ in runs) < min(end for *_, end in runs)
            with session_scope(get_sessionmaker()) as s:
                arrays = store.get_pack(s, pack_id).arrays or []
            assert sorted(len(a["trials"]) for a in arrays) == [jobs.CPU_SPLIT_MIN] * 2
            assert all(execute.SPEED not in a for a in arrays)  # not kept with the pack
        # alone: one reading of an array of 32; at once: one of the pack's two halves of 16
        [(alone, at_once)] = curves().values()
        if threads == 1:
            assert list(alone) == [2 * jobs.CPU_SPLIT_MIN] and at_once == {}
        else:
            assert alone == {} and list(at_once) == [jobs.CPU_SPLIT_MIN], at_once
            # the pack's trial-steps over its arrays' training: above what the whole span of
            # the two runs (their set-up and checkpoints included) would give
            workload = get_workload("digits-mlp")
            spe = workload.steps_per_epoch(workload.resolve(configs[0]))
            span = max(end for *_, end in runs) - min(start for *_, start, _ in runs)
            assert at_once[jobs.CPU_SPLIT_MIN] > len(configs) * 2 * spe / span
    assert all(done == 2.0 for _, done, _, _ in results[1].values())
    assert results[2] == results[1]


def test_a_key_not_yet_measured_keeps_its_pack_one_array_at_a_time(
    embedded_db: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Its job probes the device's peak memory, which arrays beside it would inflate."""
    names: set[str] = set()
    real = execute.run_array

    def spy(*args: Any, **kwargs: Any) -> Any:
        names.add(threading.current_thread().name)
        return real(*args, **kwargs)

    embedded_db.setattr(jobs, "run_array", spy)
    fresh_database(embedded_db, tmp_path / "db", 4)
    pack_id, _ = make_pack(profiled=False)
    assert jobs.run_pack(pack_id) == "completed"
    assert names == {threading.current_thread().name}


def test_out_of_memory_in_one_array_splits_the_pack_after_the_others_stop(
    embedded_db: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fresh_database(embedded_db, tmp_path / "db", 4)
    pack_id, ids = make_pack()
    real = execute.run_array
    finished: list[str] = []

    def one_fails(job: execute.ArrayJob, *args: Any, **kwargs: Any) -> None:
        if job.members[0].config["hidden"] == 24:
            raise torch.cuda.OutOfMemoryError("injected for one array")
        real(job, *args, **kwargs)
        finished.append(job.fusion_key)

    embedded_db.setattr(jobs, "run_array", one_fails)
    assert jobs.run_pack(pack_id) == "split"
    assert len(finished) == 3  # the others ran to their end before the pack was split
    with session_scope(get_sessionmaker()) as s:
        assert store.get_pack(s, pack_id).status == PackStatus.split
        statuses = {store.get_trial(s, tid).status for tid in ids}
    assert TrialStatus.failed not in statuses


@pytest.mark.parametrize(
    ("device", "torch_threads", "cores", "setting", "arrays", "expected"),
    [
        ("cuda", 4, 16, None, 2, 2),
        ("cuda", 4, 16, None, 9, jobs.GPU_ARRAY_THREADS),
        ("cpu", 1, 2, None, 3, 2),  # one torch thread: a thread per core
        ("cpu", 15, 16, None, 3, 1),  # every op already uses the cores
        ("cpu", 1, 2, 1, 3, 1),  # PACKTUNE_ARRAY_THREADS=1: one after another
        ("cpu", 15, 16, 3, 2, 2),
    ],
)
def test_how_many_arrays_train_at_once(
    clean_env: pytest.MonkeyPatch, device: str, torch_threads: int, cores: int,
    setting: int | None, arrays: int, expected: int,
) -> None:  # fmt: skip
    if setting is not None:
        clean_env.setenv("PACKTUNE_ARRAY_THREADS", str(setting))
    clean_env.setattr(jobs.os, "cpu_count", lambda: cores)
    clean_env.setattr(jobs.torch, "get_num_threads", lambda: torch_threads)
    assert jobs.array_threads(torch.device(device), arrays) == expected


def test_a_pack_at_once_is_read_at_one_size_only_where_its_arrays_are_about_that_size(
    embedded_db: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The reading is the pack's trial-steps over its arrays' span, under the largest array's
    size, where two arrays or more are at least half of it; runs lose their speed entries."""
    fresh_database(embedded_db, tmp_path / "db", 2)
    key = "digits-mlp|k"

    def attempt(sizes: list[int], spans: list[tuple[float, float]], keys: str = "k") -> Any:
        arrays = [
            SimpleNamespace(workload="digits-mlp", fusion_key=f"digits-mlp|{keys[i % len(keys)]}")
            for i in range(len(sizes))
        ]
        runs = [
            {"trials": [], execute.SPEED: {"trial_steps": 100 * k, "start": a, "end": b, "k": k}}
            for k, (a, b) in zip(sizes, spans, strict=True)
        ]
        jobs._record_at_once(arrays, runs, "cpu")  # type: ignore[arg-type]
        assert all(execute.SPEED not in run for run in runs)
        with session_scope(get_sessionmaker()) as s:
            return store.measured_curve(store.get_profile(s, "digits-mlp", key, "cpu"))[1]

    assert attempt([8, 3], [(0.0, 1.0), (0.0, 0.5)]) == {}  # 3 < 8 / 2: one array of 8
    assert attempt([8], [(0.0, 1.0)]) == {}  # alone
    assert attempt([8, 8], [(0.0, 1.0), (0.0, 1.0)], keys="kj") == {}  # two keys
    # 8 + 8 + 4 arrays, 2000 trial-steps from 10.0 to 12.0: 1000 trial-steps/s at 8
    assert attempt([8, 8, 4], [(10.0, 11.0), (10.0, 11.5), (11.0, 12.0)]) == {8: 1000.0}
    # a remainder's array counts too: 8 + 8 + 1 -> 1700 trial-steps over 1 s, averaged in
    assert attempt([8, 8, 1], [(20.0, 21.0), (20.0, 21.0), (20.0, 20.1)]) == {8: 1350.0}


class SmoothedMLP(DigitsMLP):
    """Label smoothing, a structural parameter its build_model keeps on the workload object
    for its loss to read."""

    name = "smoothed-mlp"
    params = {**DigitsMLP.params, "smoothing": 0.0}
    structural = DigitsMLP.structural | {"smoothing"}

    def build_model(self, config: Any) -> torch.nn.Module:
        self.smoothing = float(self.resolve(config)["smoothing"])
        return super().build_model(config)

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs, targets, label_smoothing=self.smoothing)

    def stacked_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        return None


def test_arrays_at_once_each_keep_what_build_model_set_on_the_workload(
    embedded_db: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Two arrays (smoothing 0.0 and 0.6) trained at once shared one workload object: the
    second's build_model set its smoothing while the first trained, which then trained
    with it (found by an audit). Each array now has its own copy of the workload."""
    embedded_db.setitem(registry(), SmoothedMLP.name, SmoothedMLP())
    workload = get_workload(SmoothedMLP.name)
    configs = [{"smoothing": s, "lr": lr} for s in (0.0, 0.6) for lr in (0.05, 0.2)]
    results = {}
    for threads in (1, 2):
        fresh_database(embedded_db, tmp_path / f"threads{threads}", threads)
        with session_scope(get_sessionmaker()) as s:
            spec = {**SPEC, "workload": workload.name}
            study = store.create_study(s, name="s", workload=workload.name, spec=spec, seed=5)
            store.add_trials(s, study.id, [
                {"sample_index": i, "bracket": 1, "rung": 0, "config": cfg,
                 "fusion_key": fusion_key(workload.name, workload.resolve(cfg),
                                          workload.structural_params())}
                for i, cfg in enumerate(configs)
            ])  # fmt: skip
            trials = store.trials_of(s, study.id)
            for t in trials:
                t.status = TrialStatus.queued
            for key in {t.fusion_key for t in trials}:
                store.set_memory_model(s, workload.name, key, "cpu", 2**20, 2**20)
            pack = store.create_pack(
                s, study_id=study.id, members=[(t.id, t.fusion_key, 0.0, 2.0) for t in trials]
            )
            pack.status = PackStatus.queued
            pack_id, ids = pack.id, [t.id for t in trials]
        assert jobs.run_pack(pack_id) == "completed"
        results[threads] = outcome(ids)
    assert all(done == 2.0 for _, done, _, _ in results[1].values())
    assert results[2] == results[1]
