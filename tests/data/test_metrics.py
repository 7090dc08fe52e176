"""``GET /metrics``: families and values computed from a database filled through the store."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from packtune.settings import get_settings, load_settings
from service import store
from service.api.app import create_app
from service.db import dispose_engines, session_scope, upgrade
from service.models import PackStatus, StudyStatus, TrialStatus, WorkerStatus
from tests.support.processes import imports_torch

SPEC: dict[str, Any] = {
    "name": "m",
    "workload": "digits-mlp",
    "objective": {"metric": "val_loss", "mode": "min"},
    "space": {"lr": {"type": "loguniform", "low": 1e-4, "high": 0.3}},
    "hyperband": {"max_resource": 9, "eta": 3},
    "seed": 0,
}
KEY = 'digits-mlp|{"hidden":64}'
H100 = {
    "index": 0,
    "name": "NVIDIA H100",
    "uuid": "GPU-1",
    "memory_total": 80 * 2**30,
    "memory_used": 30 * 2**30,
    "memory_free": 50 * 2**30,
    "utilization": 87,
}

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def client(
    request: pytest.FixtureRequest, clean_env: pytest.MonkeyPatch, sqlite_url: str
) -> Iterator[TestClient]:
    url = sqlite_url if request.param == "sqlite" else request.getfixturevalue("fresh_postgres")
    clean_env.setenv("PACKTUNE_DATABASE_URL", url)
    get_settings.cache_clear()
    upgrade(url)
    with TestClient(create_app()) as c:
        yield c
    dispose_engines()


def scrape(client: TestClient) -> tuple[set[str], Samples]:
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    families = list(text_string_to_metric_families(response.text))
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in families
        for sample in family.samples
    }
    return {family.name for family in families}, samples


def value(samples: Samples, metric: str, /, **labels: str) -> float:
    return samples[(metric, tuple(sorted(labels.items())))]


def _trials(n: int, status: TrialStatus) -> list[dict[str, Any]]:
    return [
        {
            "sample_index": i,
            "bracket": 0,
            "rung": 0,
            "config": {"lr": 0.01},
            "fusion_key": KEY,
            "status": status,
            "resource_done": 0.0,
        }
        for i in range(n)
    ]


def _finished_pack(
    s: Any, study_id: int, trial_id: int, status: PackStatus, seconds: float, attempts: int
) -> None:
    pack = store.create_pack(s, study_id=study_id, members=[(trial_id, KEY, 0.0, 1.0)])
    claimed = store.claim_pack(s, pack.id, worker_name="gpu-1", device="gpu-1/cuda:0")
    assert claimed is not None
    claimed.attempts = attempts
    store.finish_pack(s, claimed, status)
    claimed.started_at = claimed.finished_at - timedelta(seconds=seconds)  # type: ignore[operator]


def populate(factory: Any) -> None:
    """Two studies (running, completed), five packs, a profile, a live and a dead worker."""
    with session_scope(factory) as s:
        running = store.create_study(s, name="a", workload="digits-mlp", spec=SPEC, seed=0)
        done = store.create_study(s, name="b", workload="digits-mlp", spec=SPEC, seed=0)
        store.create_study(s, name="c", workload="digits-mlp", spec=SPEC, seed=0)  # pending
        store.move_study(s, running, StudyStatus.running)
        store.move_study(s, done, StudyStatus.running)
        store.move_study(s, done, StudyStatus.completed)
        store.add_trials(s, running.id, _trials(3, TrialStatus.running))
        store.add_trials(s, done.id, _trials(4, TrialStatus.completed))
        trial = store.trials_of(s, running.id)[0].id
        _finished_pack(s, running.id, trial, PackStatus.completed, 2.0, attempts=1)
        _finished_pack(s, running.id, trial, PackStatus.completed, 45.0, attempts=2)
        _finished_pack(s, running.id, trial, PackStatus.split, 0.3, attempts=1)
        store.create_pack(s, study_id=running.id, members=[(trial, KEY, 1.0, 3.0)])  # pending
        queued = store.create_pack(s, study_id=running.id, members=[(trial, KEY, 1.0, 3.0)])
        queued.attempts = 1
        store.queue_pack(s, queued.id, job_id="pack-5-1")
        store.record_throughput(s, "digits-mlp", KEY, "NVIDIA H100", 1, 100.0)
        store.record_throughput(s, "digits-mlp", KEY, "NVIDIA H100", 2, 180.0)
        store.set_memory_model(s, "digits-mlp", KEY, "NVIDIA H100", 1000, 250)
        store.heartbeat(s, name="old", host="h0", device_kind="NVIDIA H100", gpus=[H100])
        store.mark_dead_workers(s, timeout_seconds=-1)
        store.heartbeat(
            s,
            name="gpu-1",
            host="h1",
            device_kind="NVIDIA H100",
            gpus=[H100],
            status=WorkerStatus.busy,
        )


def test_families_and_values(client: TestClient) -> None:
    populate(client.app.state.sessionmaker)  # type: ignore[attr-defined]
    names, samples = scrape(client)
    assert {
        "packtune_database_up",
        "packtune_studies",
        "packtune_trials",
        "packtune_packs",
        "packtune_packs_dispatched",
        "packtune_packs_finished",
        "packtune_pack_duration_seconds",
        "packtune_trial_steps_per_second",
        "packtune_memory_model_bytes",
        "packtune_worker_alive",
        "packtune_worker_gpu_memory_used_bytes",
        "packtune_worker_gpu_memory_free_bytes",
        "packtune_worker_gpu_memory_total_bytes",
        "packtune_worker_gpu_utilization_ratio",
    } <= names
    assert value(samples, "packtune_database_up") == 1
    assert value(samples, "packtune_studies", status="running") == 1
    assert value(samples, "packtune_studies", status="completed") == 1
    assert value(samples, "packtune_studies", status="pending") == 1
    assert value(samples, "packtune_studies", status="failed") == 0  # zeros are exported
    assert value(samples, "packtune_trials", status="running") == 3
    assert value(samples, "packtune_trials", status="completed") == 4
    assert value(samples, "packtune_trials", status="diverged") == 0

    assert value(samples, "packtune_packs", status="pending") == 1
    assert value(samples, "packtune_packs", status="queued") == 1
    assert value(samples, "packtune_packs_dispatched_total") == 1 + 2 + 1 + 0 + 1
    assert value(samples, "packtune_packs_finished_total", status="completed") == 2
    assert value(samples, "packtune_packs_finished_total", status="split") == 1
    assert value(samples, "packtune_packs_finished_total", status="failed") == 0


def test_pack_duration_histogram(client: TestClient) -> None:
    populate(client.app.state.sessionmaker)  # type: ignore[attr-defined]
    _, samples = scrape(client)
    bucket = "packtune_pack_duration_seconds_bucket"
    # durations 0.3 s, 2 s and 45 s; unfinished packs are not counted
    assert value(samples, bucket, le="0.5") == 1
    assert value(samples, bucket, le="1.0") == 1
    assert value(samples, bucket, le="2.5") == 2
    assert value(samples, bucket, le="30.0") == 2
    assert value(samples, bucket, le="60.0") == 3
    assert value(samples, bucket, le="+Inf") == 3
    assert value(samples, "packtune_pack_duration_seconds_count") == 3
    assert value(samples, "packtune_pack_duration_seconds_sum") == pytest.approx(47.3, abs=1e-3)


def test_throughput_memory_model_and_workers(client: TestClient) -> None:
    populate(client.app.state.sessionmaker)  # type: ignore[attr-defined]
    _, samples = scrape(client)
    key = {"workload": "digits-mlp", "device_kind": "NVIDIA H100"}  # no fusion key label
    assert value(samples, "packtune_trial_steps_per_second", k="1", **key) == 100.0
    assert value(samples, "packtune_trial_steps_per_second", k="2", **key) == 180.0
    assert value(samples, "packtune_memory_model_bytes", part="base", **key) == 1000
    assert value(samples, "packtune_memory_model_bytes", part="per_trial", **key) == 250
    assert value(samples, "packtune_fusion_keys", **key) == 1
    assert not any("fusion_key" in dict(labels) for _, labels in samples)
    # a second architecture: one series still, the median speed and the largest memory
    with session_scope(client.app.state.sessionmaker) as s:  # type: ignore[attr-defined]
        store.record_throughput(s, "digits-mlp", KEY + "-wide", "NVIDIA H100", 1, 300.0)
        store.set_memory_model(s, "digits-mlp", KEY + "-wide", "NVIDIA H100", 500, 900)
    _, samples = scrape(client)
    assert value(samples, "packtune_trial_steps_per_second", k="1", **key) == 200.0
    assert value(samples, "packtune_memory_model_bytes", part="base", **key) == 1000
    assert value(samples, "packtune_memory_model_bytes", part="per_trial", **key) == 900
    assert value(samples, "packtune_fusion_keys", **key) == 2

    alive = {"host": "h1", "device_kind": "NVIDIA H100"}
    assert value(samples, "packtune_worker_alive", worker="gpu-1", **alive) == 1
    assert (
        value(samples, "packtune_worker_alive", worker="old", host="h0", device_kind="NVIDIA H100")
        == 0
    )
    gpu = {"worker": "gpu-1", "gpu": "0", "name": "NVIDIA H100"}
    assert value(samples, "packtune_worker_gpu_memory_used_bytes", **gpu) == 30 * 2**30
    assert value(samples, "packtune_worker_gpu_memory_free_bytes", **gpu) == 50 * 2**30
    assert value(samples, "packtune_worker_gpu_memory_total_bytes", **gpu) == 80 * 2**30
    assert value(samples, "packtune_worker_gpu_utilization_ratio", **gpu) == pytest.approx(0.87)
    stale = [
        key
        for key in samples
        if key[0].startswith("packtune_worker_gpu") and ("worker", "old") in key[1]
    ]
    assert stale == []  # a dead worker's last reading is not exported


def test_an_empty_database_exports_zeros(client: TestClient) -> None:
    _, samples = scrape(client)
    assert value(samples, "packtune_studies", status="running") == 0
    assert value(samples, "packtune_packs_dispatched_total") == 0
    assert value(samples, "packtune_pack_duration_seconds_count") == 0
    assert value(samples, "packtune_pack_duration_seconds_bucket", le="+Inf") == 0


def test_replicas_agree(client: TestClient, sqlite_url: str) -> None:
    """Two apps over one database (two API replicas) scrape the same numbers."""
    populate(client.app.state.sessionmaker)  # type: ignore[attr-defined]
    with TestClient(create_app(load_settings())) as other:
        first, second = scrape(client)[1], scrape(other)[1]
    assert first == second


def test_an_unreachable_database_is_reported_not_raised(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("PACKTUNE_DATABASE_URL", "postgresql://nobody@127.0.0.1:1/none")
    get_settings.cache_clear()
    with TestClient(create_app(load_settings())) as c:
        names, samples = scrape(c)
    assert names == {"packtune_database_up"}
    assert value(samples, "packtune_database_up") == 0


def test_a_scrape_does_not_import_torch(sqlite_url: str) -> None:
    upgrade(sqlite_url)
    code = (
        "from fastapi.testclient import TestClient\n"
        "from service.api.app import create_app\n"
        "r = TestClient(create_app()).get('/metrics')\n"
        "assert r.status_code == 200 and 'packtune_database_up 1.0' in r.text, r.text\n"
    )
    assert not imports_torch(code, sqlite_url)
