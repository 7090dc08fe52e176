"""Studies a user can manage and models they can take away, against a real ``packtune serve``:
``GET /api/studies?status=``, checkpoint retention when a study ends
(``PACKTUNE_KEEP_CHECKPOINTS``), ``GET .../trials/{id}/checkpoint`` and
``DELETE /api/studies/{id}``."""

from __future__ import annotations

import io
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from packtune.workloads import get_workload
from tests.support.processes import http, packtune_env, serving, wait_finished

pytestmark = pytest.mark.slow

KEEP = 2
SPEC = {
    "name": "manage",
    "workload": "digits-mlp",
    "space": {"lr": {"type": "loguniform", "low": 0.01, "high": 0.5},
              "hidden": {"type": "choice", "values": [16, 32]}},
    "hyperband": {"max_resource": 9, "min_resource": 1, "eta": 3},
    "sampler": "random",
    "seed": 3,
}  # fmt: skip


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("manage")
    env = packtune_env(
        database_url=f"sqlite:///{tmp / 'packtune.db'}", checkpoint_dir=tmp / "ckpt",
        scheduler_interval=0.2, keep_checkpoints=KEEP, read_cache_seconds=0,
    )  # fmt: skip
    with serving(env, tmp / "serve.log") as url:
        resp = http.post(f"{url}/api/studies", json=SPEC, timeout=30)
        assert resp.status_code == 201, resp.text
        study_id = resp.json()["id"]
        summary = wait_finished(url, study_id, timeout=300, log=tmp / "serve.log")
        trials = http.get(f"{url}/api/studies/{study_id}/trials", timeout=30).json()["data"]
        yield {"url": url, "id": study_id, "summary": summary, "trials": trials,
               "folder": tmp / "ckpt" / f"study-{study_id}"}  # fmt: skip


def test_the_status_filter_keeps_only_studies_in_it(study: dict[str, Any]) -> None:
    url = study["url"]
    done = http.get(f"{url}/api/studies", params={"status": "completed"}).json()
    assert [s["id"] for s in done["data"]] == [study["id"]] and done["count"] == 1
    running = http.get(f"{url}/api/studies", params={"status": ["running", "pending"]}).json()
    assert running == {"data": [], "count": 0}
    bad = http.get(f"{url}/api/studies", params={"status": "finished"})
    assert bad.status_code == 422
    assert ["query", "status", 0] in [e["loc"] for e in bad.json()["detail"]]


def test_only_the_best_stopped_trials_keep_their_checkpoints(study: dict[str, Any]) -> None:
    assert study["summary"]["status"] == "completed"
    files = {int(p.stem.split("-")[1]) for p in study["folder"].glob("trial-*.pt")}
    completed = {t["id"] for t in study["trials"] if t["status"] == "completed"}
    stopped = [t for t in study["trials"] if t["status"] == "stopped"]
    assert len(stopped) > KEEP
    assert completed <= files
    kept = files - completed
    assert len(kept) == KEEP
    # the kept ones are the furthest trained, best by val_loss among those
    ranked = sorted(stopped, key=lambda t: (-t["measured_resource"], t["metrics"]["val_loss"]))
    assert kept == {t["id"] for t in ranked[:KEEP]}


def test_the_best_model_downloads_and_scores_what_the_study_says(study: dict[str, Any]) -> None:
    url, study_id = study["url"], study["id"]
    best = study["summary"]["best_trial"]
    resp = http.get(f"{url}/api/studies/{study_id}/trials/{best['id']}/checkpoint", timeout=30)
    assert resp.status_code == 200
    assert resp.headers["content-type"] == "application/octet-stream"
    state = torch.load(io.BytesIO(resp.content), weights_only=True)
    workload = get_workload("digits-mlp")
    model = workload.build_model(state["config"])
    model.load_state_dict({**state["params"], **state["buffers"]})
    _, val = workload.data(state["config"])
    with torch.no_grad():
        val_loss = float(workload.loss(model.eval()(val.x), val.y))
    assert val_loss == pytest.approx(best["metrics"]["val_loss"], rel=1e-5)


def test_a_pruned_or_foreign_checkpoint_is_a_404_that_says_why(study: dict[str, Any]) -> None:
    url, study_id = study["url"], study["id"]
    files = {int(p.stem.split("-")[1]) for p in study["folder"].glob("trial-*.pt")}
    pruned = next(t["id"] for t in study["trials"] if t["id"] not in files)
    resp = http.get(f"{url}/api/studies/{study_id}/trials/{pruned}/checkpoint")
    assert resp.status_code == 404
    assert "PACKTUNE_KEEP_CHECKPOINTS" in resp.json()["detail"]
    other = http.get(f"{url}/api/studies/{study_id + 1}/trials/{pruned}/checkpoint")
    assert other.status_code == 404


def test_a_study_is_deleted_with_its_checkpoints_but_not_while_it_runs(
    study: dict[str, Any],
) -> None:
    url = study["url"]
    running = http.post(f"{url}/api/studies", json={**SPEC, "name": "busy"}).json()["id"]
    resp = http.delete(f"{url}/api/studies/{running}")
    assert resp.status_code == 409 and "cancel it before deleting" in resp.json()["detail"]
    assert http.post(f"{url}/api/studies/{running}/cancel").status_code == 200
    deadline = time.monotonic() + 60
    while (resp := http.delete(f"{url}/api/studies/{running}")).status_code == 409:
        assert "still has packs training" in resp.json()["detail"]
        assert time.monotonic() < deadline
        time.sleep(0.3)
    assert resp.status_code == 204

    folder: Path = study["folder"]
    assert folder.is_dir()
    assert http.delete(f"{url}/api/studies/{study['id']}").status_code == 204
    assert http.get(f"{url}/api/studies/{study['id']}").status_code == 404
    deadline = time.monotonic() + 10
    while folder.exists():  # removed after the response, in the background
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert http.delete(f"{url}/api/studies/{study['id']}").status_code == 404
