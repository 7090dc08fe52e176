"""Bad input: generated requests against the OpenAPI schema, and hand-written raw bodies.

- schemathesis generates well over 1,000 requests (valid and invalid) from the
  app's own OpenAPI document, sent in-process to the ASGI app over a SQLite
  database holding one measured study: no 5xx, every error is JSON with a
  ``detail``, every documented response matches its schema.
- a live ``packtune serve --no-scheduler`` on PostgreSQL gets what a schema
  cannot describe (bodies that are not JSON, not UTF-8, 10 MB, nested a
  hundred thousand deep; NUL characters; ids that are not numbers) and the
  spec mistakes not already sent over HTTP by ``test_api.py``: each is a clear
  4xx, and ``/healthz`` answers 200 after each.
"""

from __future__ import annotations

import json
import socket
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI

from packtune.settings import Settings
from packtune.space import fusion_key
from service import store
from service.api.app import create_app
from service.db import make_engine, session_factory, session_scope, upgrade
from service.models import PackStatus, TrialStatus
from tests.support.cluster import create_database, drop_database
from tests.support.processes import http, packtune_env, serving

SPEC: dict[str, Any] = {
    "name": "bad-input",
    "workload": "digits-mlp",
    "objective": {"metric": "val_loss", "mode": "min"},
    "space": {"lr": {"type": "loguniform", "low": 0.001, "high": 0.3}},
    "hyperband": {"max_resource": 9, "min_resource": 1, "eta": 3},
    "packing": {"enabled": True, "max_pack_size": None},
    "seed": 0,
}
EXAMPLES = 60  # per operation and generation mode


def seed_study(url: str) -> int:
    """One study with trials, measurements (one of them NaN) and a pack; returns its id."""
    engine = make_engine(url)
    try:
        with session_scope(session_factory(engine)) as s:
            study = store.create_study(s, name="seeded", workload="digits-mlp", spec=SPEC, seed=0)
            key = fusion_key("digits-mlp", {"hidden": 64}, ["hidden"])
            rows = [
                {"sample_index": i, "bracket": i % 3, "rung": 0, "config": {"lr": 0.01 * (i + 1)},
                 "fusion_key": key, "status": TrialStatus.paused, "resource_done": 1.0}
                for i in range(6)
            ]  # fmt: skip
            store.add_trials(s, study.id, rows)
            trials = store.trials_of(s, study.id)
            for t in trials:
                loss = float("nan") if t.sample_index == 5 else 1.0 / (t.sample_index + 1)
                store.record_measurement(s, t.id, 1.0, {"val_loss": loss, "train_loss": loss})
            pack = store.create_pack(
                s, study_id=study.id, members=[(t.id, key, 0.0, 1.0) for t in trials[:3]]
            )
            store.move_pack(s, pack, PackStatus.running)
            store.finish_pack(s, pack, PackStatus.completed, train_seconds=0.5)
            return study.id
    finally:
        engine.dispose()


@pytest.fixture(scope="module")
def app_and_study(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FastAPI, int]]:
    url = f"sqlite:///{tmp_path_factory.mktemp('badinput') / 'packtune.db'}"
    upgrade(url)
    study_id = seed_study(url)
    yield create_app(Settings(database_url=url, api_token=None)), study_id


def _check(case: Any, response: Any) -> None:
    from schemathesis.checks import content_type_conformance, response_schema_conformance

    status = response.status_code
    assert status < 500, f"{case.method} {case.formatted_path} -> {status}: {response.text}"
    if status >= 400:
        (content_type,) = response.headers["content-type"]  # schemathesis: lists of values
        assert content_type.startswith("application/json"), response.text
        assert response.json()["detail"], response.text
    case.validate_response(response, checks=[response_schema_conformance, content_type_conformance])


def _fuzz(strategy: Any, sent: Counter[str], name: str) -> None:
    """Send ``EXAMPLES`` requests drawn from ``strategy``, checking each response."""
    from hypothesis import HealthCheck, given, settings

    @given(case=strategy)
    @settings(
        max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
        suppress_health_check=list(HealthCheck),
    )  # fmt: skip
    def run(case: Any) -> None:
        sent[name] += 1
        _check(case, case.call())

    run()


def test_generated_requests_get_no_server_error(app_and_study: tuple[FastAPI, int]) -> None:
    import schemathesis
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    app, study_id = app_and_study
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    sent: Counter[str] = Counter()
    for result in schema.get_all_operations():
        op = result.ok()
        name = f"{op.method.upper()} {op.path}"
        strategies = {
            "valid": op.as_strategy(GenerationMode.POSITIVE),
            "invalid": op.as_strategy(GenerationMode.NEGATIVE),
        }
        if "{study_id}" in op.path:  # the ids above are mostly unknown: this one exists
            strategies["seeded"] = op.as_strategy(
                GenerationMode.POSITIVE, path_parameters={"study_id": study_id}
            )
        for mode, strategy in strategies.items():
            try:
                _fuzz(strategy, sent, name)
            except Unsatisfiable:  # nothing in the request can be made invalid
                assert mode == "invalid" and not op.path_parameters and not op.query, name
    print(f"{sum(sent.values())} generated requests: {dict(sent)}")
    assert sum(sent.values()) >= 1000
    assert len(sent) >= 13
    with create_client(app) as client:
        assert client.get("/healthz").status_code == 200


def create_client(app: FastAPI) -> Any:
    from fastapi.testclient import TestClient

    return TestClient(app)


# -- a live server on PostgreSQL ------------------------------------------------------------


@pytest.fixture(scope="module")
def live(postgres_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``packtune serve --no-scheduler`` over a fresh PostgreSQL database; its base URL."""
    name = f"packtune_badinput_{uuid.uuid4().hex[:8]}"
    url = create_database(postgres_url, name)
    tmp = tmp_path_factory.mktemp("live")
    try:
        upgrade(url)
        seed_study(url)
        with serving(packtune_env(database_url=url), tmp / "serve.log", "--no-scheduler") as base:
            yield base
    finally:
        drop_database(postgres_url, name)


def valid(**changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = {**SPEC, "name": "ok"}
    body.update(changes)
    return body


JSON = "application/json"
TEN_MB = 10 * 2**20


def _chunks(total: int, size: int = 64 * 1024) -> Iterator[bytes]:
    for start in range(0, total, size):
        yield b" " * min(size, total - start)


RAW: list[tuple[str, Any, str, int]] = [
    ("not JSON", b"{name: ok", JSON, 422),
    ("not UTF-8", '{"name": "é"}'.encode("latin-1"), JSON, 400),
    ("10 MB with its length", b"x" * TEN_MB, JSON, 413),
    ("10 MB chunked", "chunks", JSON, 413),
    ("nested 100,000 deep", b"[" * 100_000 + b"]" * 100_000, JSON, 400),
    (
        "NUL in the name",
        b'{"name": "a\\u0000b", "workload": "digits-mlp", "space": {}, '
        b'"hyperband": {"max_resource": 3}}',
        JSON,
        422,
    ),  # fmt: skip
    (
        "a lone surrogate",
        b'{"name": "\\ud800", "workload": "digits-mlp", "space": {}, '
        b'"hyperband": {"max_resource": 3}}',
        JSON,
        422,
    ),  # fmt: skip
    ("XML", b"<study/>", "application/xml", 422),
    ("no body", b"", JSON, 422),
]


@pytest.mark.parametrize(
    ("what", "content", "content_type", "status"), RAW, ids=[r[0] for r in RAW]
)
def test_raw_bodies_are_4xx(
    live: str, what: str, content: Any, content_type: str, status: int
) -> None:
    if content == "chunks":
        content = _chunks(TEN_MB)  # no Content-Length: the server must count
    response = http.post(
        f"{live}/api/studies", content=content, headers={"content-type": content_type}, timeout=60
    )
    assert response.status_code == status, response.text
    assert response.json()["detail"]
    assert http.get(f"{live}/healthz", timeout=10).status_code == 200


SPECS: list[tuple[str, dict[str, Any], list[Any]]] = [
    ("low > high", valid(space={"lr": {"type": "uniform", "low": 0.5, "high": 0.1}}),
     ["body", "space", "lr", "low"]),
    ("min > max resource", valid(hyperband={"max_resource": 3, "min_resource": 9}),
     ["body", "hyperband", "max_resource"]),
    ("empty choice", valid(space={"hidden": {"type": "choice", "values": []}}),
     ["body", "space", "hidden", "values"]),
    ("bad mode", valid(objective={"metric": "val_loss", "mode": "best"}),
     ["body", "objective", "mode"]),
    ("accuracy minimised", valid(objective={"metric": "val_accuracy", "mode": "min"}),
     ["body", "objective", "mode"]),
    ("eta 1", valid(hyperband={"max_resource": 9, "eta": 1}), ["body", "hyperband", "eta"]),
    ("max_resource 10^9", valid(hyperband={"max_resource": 10**9}),
     ["body", "hyperband", "max_resource"]),
    ("a spec that is a list", [SPEC], ["body"]),  # type: ignore[list-item]
]  # fmt: skip


@pytest.mark.parametrize(("what", "body", "loc"), SPECS, ids=[s[0] for s in SPECS])
def test_bad_specs_are_422_naming_the_field(
    live: str, what: str, body: dict[str, Any], loc: list[Any]
) -> None:
    response = http.post(f"{live}/api/studies", json=body, timeout=30)
    assert response.status_code == 422, response.text
    assert loc in [entry["loc"] for entry in response.json()["detail"]], response.text
    assert http.get(f"{live}/healthz", timeout=10).status_code == 200


#: specs of which every trial failed when it trained (or measured), accepted before
DOOMED: list[tuple[str, dict[str, Any], list[Any]]] = [
    ("more segments than layers", valid(training={"mode": "decoupled", "segments": 4}),
     ["body", "training", "segments"]),
    ("a decoupled regression",
     valid(workload="synthetic-mlp", space={"task": {"type": "choice", "values": ["regression"]}},
           training={"mode": "decoupled", "segments": 2}),
     ["body", "training", "mode"]),
    ("val_r2 of a classification",
     valid(workload="synthetic-mlp", objective={"metric": "val_r2", "mode": "max"}, space={}),
     ["body", "objective", "metric"]),
]  # fmt: skip


@pytest.mark.parametrize(("what", "body", "loc"), DOOMED, ids=[s[0] for s in DOOMED])
def test_specs_no_trial_could_train_are_422_naming_the_field_and_store_nothing(
    live: str, what: str, body: dict[str, Any], loc: list[Any]
) -> None:
    before = http.get(f"{live}/api/studies", timeout=10).json()["count"]
    response = http.post(f"{live}/api/studies", json=body, timeout=30)
    assert response.status_code == 422, response.text
    assert [loc] == [entry["loc"] for entry in response.json()["detail"]], response.text
    assert http.get(f"{live}/api/studies", timeout=10).json()["count"] == before


HUGE = "9" * 5000  # over Python's 4,300 digits for int(): the body could not be read


@pytest.mark.parametrize(
    ("body", "loc"),
    [
        (json.dumps(valid(seed=0)).replace('"seed": 0', f'"seed": {HUGE}'), ["body", "seed"]),
        (json.dumps(valid(space={"hidden": {"type": "choice", "values": [64, 0]}}))
         .replace(", 0]", f", -{HUGE}]"), ["body", "space", "hidden", "values", "1"]),
    ],
    ids=["seed", "a choice's value"],
)  # fmt: skip
def test_an_integer_too_long_to_read_is_422_naming_its_field(
    live: str, body: str, loc: list[Any]
) -> None:
    """It was a 400 for the whole body ("There was an error parsing the body")."""
    before = http.get(f"{live}/api/studies", timeout=10).json()["count"]
    response = http.post(
        f"{live}/api/studies", content=body.encode(), headers={"content-type": JSON}, timeout=30
    )
    assert response.status_code == 422, response.text
    (entry,) = response.json()["detail"]
    assert entry["loc"] == loc and "5000 digits" in entry["msg"], entry
    assert http.get(f"{live}/api/studies", timeout=10).json()["count"] == before
    assert http.get(f"{live}/healthz", timeout=10).status_code == 200


PATHS = [
    ("/api/studies/999999", 404),
    ("/api/studies/999999/trials", 404),
    ("/api/studies/999999/leaderboard", 404),
    ("/api/studies/abc", 422),
    ("/api/studies/1.5/packs", 422),
    ("/api/studies/-3/curves", 422),
    ("/api/studies/99999999999999999999999", 422),
    ("/api/studies?offset=9223372036854775808", 422),
    ("/api/studies/1/packs?offset=99999999999", 422),
    ("/api/studies/1/curves?trial_id=x", 422),
    ("/api/studies/1/leaderboard?limit=0", 422),
    ("/api/studies/1/trials?status=finished-ish", 422),
    ("/api/no-such-thing", 404),
]


@pytest.mark.parametrize(("path", "status"), PATHS)
def test_bad_ids_and_queries_are_4xx(live: str, path: str, status: int) -> None:
    response = http.get(f"{live}{path}", timeout=30)
    assert response.status_code == status, response.text
    assert response.json()["detail"]


def test_a_bad_content_length_is_400_and_garbage_does_not_hurt(live: str) -> None:
    host, port = live.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /api/studies HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 12abc\r\nConnection: close\r\n\r\n{}"
        )
        reply = sock.recv(4096)
    assert reply.startswith(b"HTTP/1.1 400"), reply
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"\x00\xff garbage that is not HTTP\r\n\r\n")
        sock.recv(4096)  # the server answers or closes; either way it lives on
    assert http.get(f"{live}/healthz", timeout=10).status_code == 200


def test_still_serving_after_all_that(live: str, tmp_path: Path) -> None:
    created = http.post(f"{live}/api/studies", json=valid(name="after"), timeout=30)
    assert created.status_code == 201, created.text
    study_id = created.json()["id"]
    assert http.get(f"{live}/api/studies/{study_id}", timeout=10).json()["name"] == "after"
    listing = http.get(f"{live}/api/studies", timeout=10).json()
    assert listing["count"] >= 2
    assert http.get(f"{live}/healthz", timeout=10).json() == {"status": "ok"}


def test_a_body_that_does_not_come_is_408_not_a_held_connection(tmp_path: Path) -> None:
    """A client that declares a body and sends part of it (slowloris) is answered 408 once a
    part is late; the server goes on serving others."""
    import socket

    env = packtune_env(database_url=f"sqlite:///{tmp_path / 'packtune.db'}", body_timeout=1)
    with serving(env, tmp_path / "serve.log", "--no-scheduler") as live:  # the API alone
        host, port = live.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(
                b"POST /api/studies HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
            )
            started = time.monotonic()
            answer = sock.recv(4096)
            waited = time.monotonic() - started
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert 0.5 < waited < 5, waited
        assert http.get(f"{live}/healthz", timeout=10).status_code == 200
