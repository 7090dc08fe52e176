"""Writes that race on one study, against a live ``packtune serve --no-scheduler`` on
PostgreSQL: the request that loses to a DELETE finds the study gone (404), never a 500."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from service.db import upgrade
from tests.support.cluster import create_database, drop_database, wait_for
from tests.support.processes import http, packtune_env, serving

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

SPEC: dict[str, Any] = {
    "name": "race",
    "workload": "digits-mlp",
    "space": {"lr": {"type": "loguniform", "low": 0.01, "high": 0.3}},
    "hyperband": {"max_resource": 1},
}

WRITES: dict[str, Callable[[str, int], httpx.Response]] = {
    "delete": lambda base, i: http.delete(f"{base}/api/studies/{i}"),
    "cancel": lambda base, i: http.post(f"{base}/api/studies/{i}/cancel"),
    "patch": lambda base, i: http.patch(f"{base}/api/studies/{i}", json={"priority": 2}),
    "retry": lambda base, i: http.post(f"{base}/api/studies/{i}/retry"),
}


@pytest.fixture(scope="module")
def live(postgres_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """The base URL of ``packtune serve --no-scheduler`` over a fresh database, and that
    database's URL."""
    name = f"packtune_races_{uuid.uuid4().hex[:8]}"
    url = create_database(postgres_url, name)
    log = Path(tmp_path_factory.mktemp("races")) / "serve.log"
    try:
        upgrade(url)
        with serving(packtune_env(database_url=url), log, "--no-scheduler") as base:
            yield base, url
    finally:
        drop_database(postgres_url, name)


def new_study(base: str, *, cancelled: bool) -> int:
    study_id = int(http.post(f"{base}/api/studies", json=SPEC).json()["id"])
    if cancelled:
        assert http.post(f"{base}/api/studies/{study_id}/cancel").status_code == 200
    return study_id


def waiting_on_a_lock(conn: sa.Connection) -> bool:
    query = sa.text(
        "select count(*) from pg_stat_activity"
        " where datname = current_database() and wait_event_type = 'Lock'"
    )
    return bool(conn.execute(query).scalar())


@pytest.mark.parametrize("write", list(WRITES))
def test_a_write_that_waited_for_a_delete_is_404(live: tuple[str, str], write: str) -> None:
    """The study is deleted (in another transaction, not yet committed) after the request
    read it and while it waits for the study's row lock: it answers 404 once the delete
    commits (it was a 500, 'Could not refresh instance')."""
    base, url = live
    study_id = new_study(base, cancelled=True)
    engine = sa.create_engine(url)
    answers: list[httpx.Response] = []
    try:
        with engine.connect() as deleting, engine.connect() as watching:
            deleting.execute(sa.text("delete from studies where id = :i"), {"i": study_id})
            request = threading.Thread(target=lambda: answers.append(WRITES[write](base, study_id)))
            request.start()
            wait_for(lambda: waiting_on_a_lock(watching), 30, "the request to wait for the row")
            deleting.commit()
            request.join(30)
    finally:
        engine.dispose()
    assert [a.status_code for a in answers] == [404], [a.text for a in answers]
    assert f"study {study_id}" in answers[0].json()["detail"]


def at_once(base: str, study_id: int, writes: dict[str, str]) -> dict[str, int]:
    """Each named write (a key of :data:`WRITES`) sent from its own thread, released
    together; the status code each got."""
    start = threading.Barrier(len(writes))
    answers: dict[str, int] = {}

    def send(name: str, write: str) -> None:
        start.wait(10)
        answers[name] = WRITES[write](base, study_id).status_code

    threads = [threading.Thread(target=send, args=item) for item in writes.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return answers


def test_deletes_and_a_retry_at_once_are_one_204_and_no_500(live: tuple[str, str]) -> None:
    """Three DELETEs and a retry of one cancelled study at once: one DELETE wins, the other
    requests are 404 (gone) or 409 (retry of a study that is not failed)."""
    base, _ = live
    writes = {"delete 1": "delete", "delete 2": "delete", "delete 3": "delete", "retry": "retry"}
    for _ in range(3):
        answers = at_once(base, new_study(base, cancelled=True), writes)
        deletes = sorted(answers[name] for name in writes if name != "retry")
        assert deletes[0] == 204 and set(deletes[1:]) <= {404}, answers
        assert answers["retry"] in (404, 409), answers
