"""End to end: real ``packtune`` processes run a Hyperband study to the end.

(a) embedded (``packtune serve``: SQLite, packs in a child process), packed;
(b) the same study unpacked (``max_pack_size: 1``): same metrics, same best, more jobs;
(c) PostgreSQL + Redis + ``packtune scheduler`` + two ``packtune worker`` processes;
(d) (a) with two embedded runners.
"""

from __future__ import annotations

import math
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.support.processes import (
    check_hyperband,
    final_metrics,
    http,
    packtune_env,
    serving,
    start,
    stop,
    wait_finished,
)

pytestmark = pytest.mark.slow

SPEC: dict[str, Any] = {
    "name": "e2e-digits",
    "workload": "digits-mlp",
    "objective": {"metric": "val_loss", "mode": "min"},
    "space": {
        "lr": {"type": "loguniform", "low": 0.005, "high": 0.5},
        "momentum": {"type": "uniform", "low": 0.0, "high": 0.9},
        "hidden": {"type": "choice", "values": [32, 64]},
    },
    "hyperband": {"max_resource": 9, "min_resource": 1, "eta": 3},
    "packing": {"enabled": True, "max_pack_size": None},
    "seed": 7,
}


def run_study(url: str, spec: dict[str, Any], log: Path) -> dict[str, Any]:
    """Submit ``spec``, wait for the end, and collect what the API says of it."""
    resp = http.post(f"{url}/api/studies", json=spec, timeout=30)
    assert resp.status_code == 201, resp.text
    study_id = resp.json()["id"]
    summary = wait_finished(url, study_id, timeout=240, log=log)
    get = lambda path: http.get(f"{url}/api/studies/{study_id}/{path}", timeout=30).json()  # noqa: E731
    trials = get("trials")["data"]
    return {
        "summary": summary,
        "trials": trials,
        "curves": final_metrics(get("curves")["data"], "val_loss"),
        "packs": get("packs?limit=500")["data"],
    }


def check_result(spec: dict[str, Any], result: dict[str, Any]) -> None:
    summary, trials, curves = result["summary"], result["trials"], result["curves"]
    assert summary["status"] == "completed", summary
    assert summary["progress"]["done"] == summary["progress"]["total"]
    check_hyperband(spec, trials, curves)
    # the best trial is the best measured at max_resource
    max_r = float(spec["hyperband"]["max_resource"])
    finals = {tid: pts[max_r] for tid, pts in curves.items() if max_r in pts}
    best_id = min(finals, key=lambda tid: (finals[tid], tid))
    assert summary["best_trial"]["id"] == best_id
    assert summary["best_trial"]["metrics"]["val_loss"] == pytest.approx(finals[best_id])
    assert all(p["status"] == "completed" for p in result["packs"]), result["packs"]


def same_metrics(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Same trials (matched by sample order), same curves to float rounding, same best."""
    assert len(a["trials"]) == len(b["trials"])
    order_a = sorted(a["curves"])
    order_b = sorted(b["curves"])
    largest = 0.0
    for ta, tb in zip(order_a, order_b, strict=True):
        ca, cb = a["curves"][ta], b["curves"][tb]
        assert sorted(ca) == sorted(cb)
        for r in ca:
            if ca[r] is None or not math.isfinite(ca[r]):
                assert cb[r] is None or not math.isfinite(cb[r])
                continue
            largest = max(largest, abs(ca[r] - cb[r]))
            assert cb[r] == pytest.approx(ca[r], rel=1e-4, abs=1e-5), (ta, r)
    print(f"largest val_loss difference: {largest:.3g}")
    ids_a = {t: i for i, t in enumerate(order_a)}
    ids_b = {t: i for i, t in enumerate(order_b)}
    assert ids_a[a["summary"]["best_trial"]["id"]] == ids_b[b["summary"]["best_trial"]["id"]]


@pytest.fixture(scope="module")
def embedded_packed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("packed")
    env = packtune_env(
        database_url=f"sqlite:///{tmp / 'packtune.db'}",
        checkpoint_dir=tmp / "ckpt",
        scheduler_interval=0.2,
    )
    log = tmp / "serve.log"
    with serving(env, log) as url:
        return {**run_study(url, SPEC, log), "checkpoint_dir": tmp / "ckpt"}


def test_embedded_study_completes_as_hyperband_says(embedded_packed: dict[str, Any]) -> None:
    check_result(SPEC, embedded_packed)
    sizes = [len(p["members"]) for p in embedded_packed["packs"]]
    assert max(sizes) > 1, f"nothing was packed: {sizes}"


def test_unpacked_study_gives_the_same_results_in_more_jobs(
    embedded_packed: dict[str, Any], tmp_path: Path
) -> None:
    spec = {**SPEC, "packing": {"enabled": True, "max_pack_size": 1}}
    env = packtune_env(
        database_url=f"sqlite:///{tmp_path / 'packtune.db'}",
        checkpoint_dir=tmp_path / "ckpt",
        scheduler_interval=0.2,
    )
    log = tmp_path / "serve.log"
    with serving(env, log) as url:
        unpacked = run_study(url, spec, log)
    check_result(spec, unpacked)
    assert all(len(p["members"]) == 1 for p in unpacked["packs"])
    assert len(unpacked["packs"]) > len(embedded_packed["packs"])
    same_metrics(embedded_packed, unpacked)


def test_two_embedded_runners_share_the_study_with_the_same_results(
    embedded_packed: dict[str, Any], tmp_path: Path
) -> None:
    """``PACKTUNE_EMBEDDED_RUNNERS=2``: ``packtune serve``'s packs go to two runner processes,
    each a worker of its own, and the study ends as with one."""
    env = packtune_env(
        database_url=f"sqlite:///{tmp_path / 'packtune.db'}",
        checkpoint_dir=tmp_path / "ckpt",
        scheduler_interval=0.2,
        embedded_runners=2,
        device="cpu",
    )
    log = tmp_path / "serve.log"
    with serving(env, log) as url:
        result = run_study(url, SPEC, log)
        workers = http.get(f"{url}/api/workers").json()["data"]
    check_result(SPEC, result)
    names = {w["name"] for w in workers}
    assert len(names) == 2 and all(n.startswith(("embedded@", "embedded-2@")) for n in names)
    # several packs are ready at once (Hyperband's first rungs): the second runner takes one
    assert {p["worker"] for p in result["packs"]} == names
    same_metrics(embedded_packed, result)


def test_postgres_redis_scheduler_and_two_workers(
    embedded_packed: dict[str, Any], fresh_postgres: str, redis_url: str, tmp_path: Path
) -> None:
    queue = f"e2e-{uuid.uuid4().hex[:8]}"
    env = packtune_env(
        database_url=fresh_postgres,
        redis_url=redis_url,
        queue_name=queue,
        checkpoint_dir=tmp_path / "ckpt",
        scheduler_interval=0.2,
        heartbeat_interval=1,
        cpu_memory_budget=2**30,
    )
    log = tmp_path / "services.log"
    procs = [start(["db", "upgrade"], env, log)]
    assert procs[0].wait(60) == 0, log.read_text()
    procs = [
        start(["scheduler"], env, log),
        start(["worker", "--name", "w1"], env, log),
        start(["worker", "--name", "w2"], env, log),
    ]
    try:
        with serving(env, tmp_path / "api.log", "--no-scheduler") as url:
            result = run_study(url, SPEC, log)
            workers = http.get(f"{url}/api/workers").json()["data"]
    finally:
        for proc in procs:
            stop(proc)
    check_result(SPEC, result)
    assert {w["name"] for w in workers} >= {"w1", "w2"}
    used = {p["worker"] for p in result["packs"]}
    assert used <= {"w1", "w2"}, used
    same_metrics(embedded_packed, result)


def test_the_best_model_can_be_taken_away(embedded_packed: dict[str, Any]) -> None:
    """docs/workloads.md, "Taking a trained model away": the best trial's checkpoint loads
    into the workload's model, which scores on the validation split what the study says."""
    import torch

    from packtune.checkpoints import checkpoint_path
    from packtune.workloads import get_workload

    summary = embedded_packed["summary"]
    best = summary["best_trial"]
    path = checkpoint_path(embedded_packed["checkpoint_dir"], summary["id"], best["id"])
    state = torch.load(path, weights_only=True)  # "to load one by hand", as the guide says
    workload = get_workload(summary["workload"])
    model = workload.build_model(state["config"])
    model.load_state_dict({**state["params"], **state["buffers"]})
    _, val = workload.data(state["config"])
    with torch.no_grad():
        loss = float(workload.loss(model.eval()(val.x), val.y))
    assert loss == pytest.approx(best["metrics"]["val_loss"], rel=1e-5)
