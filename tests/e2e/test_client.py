"""``packtune.Client`` and the CLI's remote commands, against a real ``packtune serve``
(embedded runner, SQLite, a bearer token), and the CLI through its entry point."""

from __future__ import annotations

import csv
import io
import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import yaml

from packtune import ApiError, Client, Study, Trial
from packtune.client import FLAT_COLUMNS
from packtune.workloads import get_workload
from tests.support.processes import packtune_env, serving

pytestmark = pytest.mark.slow

TOKEN = "client-test-token"
SPEC = {
    "name": "client",
    "workload": "digits-mlp",
    "space": {"lr": {"type": "loguniform", "low": 0.01, "high": 0.5}},
    "hyperband": {"max_resource": 3, "min_resource": 1, "eta": 3},
    "seed": 2,
}


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("client")
    env = packtune_env(
        database_url=f"sqlite:///{tmp / 'packtune.db'}", checkpoint_dir=tmp / "ckpt",
        scheduler_interval=0.2, api_token=TOKEN,
    )  # fmt: skip
    spec = tmp / "study.yaml"
    spec.write_text(yaml.safe_dump(SPEC))
    with serving(env, tmp / "serve.log") as url:
        with Client(url, TOKEN) as client:
            study = client.wait(client.create_study(spec), timeout=300)
        yield {"url": url, "env": env, "study": study, "spec": spec, "tmp": tmp}


def cli(service: dict[str, Any], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "service", *args, "--url", service["url"]],
        env={**service["env"], "PACKTUNE_API_TOKEN": TOKEN}, capture_output=True, text=True,
        timeout=300, cwd=service["tmp"],
    )  # fmt: skip


def test_a_study_made_from_a_file_runs_and_reads_back_typed(service: dict[str, Any]) -> None:
    study = service["study"]
    assert isinstance(study, Study) and study.status == "completed" and study.finished
    assert study.progress[0] == study.progress[1] > 0
    with Client(service["url"]) as client:  # reads need no token
        assert client.get_study(study.id) == study
        assert [s.id for s in client.studies(status="completed")] == [study.id]
        assert client.studies(status=["running", "pending"]) == []
        trials = client.trials(study, status="completed")
        assert trials and all(isinstance(t, Trial) and t.status == "completed" for t in trials)
        board = client.leaderboard(study, limit=3)
        assert board[0].id == study.best_trial_id and len(board) == 3
        values = [t.metrics["val_loss"] for t in board if t.measured_resource == 3]
        assert values == sorted(values)


def test_a_flat_row_says_how_far_a_trial_trained_and_where_it_was_measured() -> None:
    """One meaning of ``resource`` in the CSV, the dataframe and the JSON (the API's: how far
    it trained); before, the flat row's ``resource`` was where it was last measured (a
    trial 2 epochs in, measured at 1, showed 1 in the CSV and 2 in the JSON)."""
    row = {"id": 4, "status": "running", "config": {"lr": 0.1}, "bracket": 1, "rung": 0,
           "resource": 2.0, "measured_resource": 1.0, "metrics": {"val_loss": 0.5},
           "iteration": 2, "error": None}  # fmt: skip
    flat = Trial.of(row).flat()
    assert list(flat)[: len(FLAT_COLUMNS)] == list(FLAT_COLUMNS)  # an empty CSV's header
    assert (flat["resource"], flat["measured_resource"]) == (2.0, 1.0)
    assert flat["config.lr"] == 0.1 and flat["metric.val_loss"] == 0.5
    # which iteration (a budget runs several: bracket and rung repeat) and why it failed:
    # the JSON had both, the CSV and the dataframe neither
    assert (flat["iteration"], flat["error"]) == (2, None)
    failed = Trial.of({**row, "status": "failed", "error": "ValueError: odd width"}).flat()
    assert failed["error"] == "ValueError: odd width"


def test_trials_come_as_a_dataframe(service: dict[str, Any]) -> None:
    with Client(service["url"]) as client:
        frame = client.trials_dataframe(service["study"])
        count = len(client.trials(service["study"]))
    assert len(frame) == count
    assert {"id", "status", "config.lr", "metric.val_loss"} <= set(frame.columns)


def test_the_best_model_is_one_call_away(service: dict[str, Any]) -> None:
    study = service["study"]
    with Client(service["url"]) as client:
        model, config = client.best_model(study)
    assert isinstance(model, torch.nn.Module) and not model.training
    workload = get_workload("digits-mlp")
    _, val = workload.data(config)
    with torch.no_grad():
        val_loss = float(workload.loss(model(val.x), val.y))
    assert study.best_metrics is not None
    assert val_loss == pytest.approx(study.best_metrics["val_loss"], rel=1e-5)


def test_refusals_carry_the_api_detail(service: dict[str, Any]) -> None:
    url = service["url"]
    with Client(url) as anonymous, pytest.raises(ApiError) as caught:
        anonymous.create_study(SPEC)
    assert caught.value.status_code == 401
    with Client(url, TOKEN) as client:
        bad = {**SPEC, "space": {"lr": {"type": "uniform", "low": 1.0, "high": 0.1}}}
        with pytest.raises(ApiError) as caught:
            client.create_study(bad)
        assert caught.value.status_code == 422 and "space.lr.low" in caught.value.detail
        with pytest.raises(ApiError) as caught:
            client.get_study(99_999)
        assert caught.value.status_code == 404 and "99999" in caught.value.detail
        running = client.create_study({**SPEC, "name": "to-cancel"})
        with pytest.raises(ApiError) as caught:
            client.delete(running)
        assert caught.value.status_code == 409
        assert client.cancel(running).status == "cancelled"
        check = client.check("digits-mlp", members=2, steps=1)
        assert check["status"] == "passed" and check["report"]["stacks"] == [[[0, 1], "bmm"]]


def test_the_cli_lists_shows_exports_and_takes_the_best_model(service: dict[str, Any]) -> None:
    study = service["study"]
    listed = cli(service, "studies", "--status", "completed")
    assert listed.returncode == 0, listed.stderr
    assert "client" in listed.stdout and "completed" in listed.stdout
    shown = cli(service, "show", str(study.id))
    assert shown.returncode == 0, shown.stderr
    assert f"study {study.id} client (digits-mlp): completed" in shown.stdout
    assert "leaderboard" in shown.stdout

    exported = cli(service, "export", str(study.id), "--format", "csv")
    assert exported.returncode == 0, exported.stderr
    rows = list(csv.DictReader(io.StringIO(exported.stdout)))
    assert {"id", "status", "config.lr", "metric.val_loss"} <= set(rows[0])
    as_json = cli(service, "export", str(study.id), "--format", "json")
    assert len(json.loads(as_json.stdout)) == len(rows)
    trained = {int(r["id"]): float(r["resource"]) for r in json.loads(as_json.stdout)}
    assert {int(r["id"]): float(r["resource"]) for r in rows} == trained

    out = service["tmp"] / "best.pt"
    taken = cli(service, "best", str(study.id), "--out", str(out))
    assert taken.returncode == 0, taken.stderr
    state = torch.load(out, weights_only=True)
    assert state["config"]["lr"] == pytest.approx(
        next(float(r["config.lr"]) for r in rows if int(r["id"]) == study.best_trial_id)
    )


def test_cli_refusals_are_one_line_and_exit_2(service: dict[str, Any], tmp_path: Path) -> None:
    missing = cli(service, "show", "99999")
    assert missing.returncode == 2
    assert missing.stderr.strip() == "error: 404: study 99999 not found"
    away = subprocess.run(
        [sys.executable, "-m", "service", "studies", "--url", "http://127.0.0.1:9"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert away.returncode == 2 and "cannot reach http://127.0.0.1:9" in away.stderr
    # a URL httpx cannot parse, a priority JSON cannot carry: tracebacks, or the service
    # blamed ("unexpected answer ... is it packtune?") for a request never sent
    malformed = subprocess.run(
        [sys.executable, "-m", "service", "show", "1", "--url", "http://[::1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert malformed.returncode == 2 and "not a URL" in malformed.stderr, malformed.stderr
    for value in ("nan", "inf"):
        odd = cli(service, "update", "1", "--priority", value)
        assert odd.returncode == 2 and "--priority must be a finite number" in odd.stderr
    for done in (missing, away, malformed, odd):
        assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_the_cli_updates_cancels_and_deletes(service: dict[str, Any]) -> None:
    long = service["tmp"] / "long.yaml"  # 143 trials: still running when cancelled
    long.write_text(yaml.safe_dump({**SPEC, "name": "long", "hyperband": {"max_resource": 81}}))
    submitted = cli(service, "submit", str(long))
    assert submitted.returncode == 0, submitted.stderr
    study_id = submitted.stdout.split()[1]
    refused = cli(service, "delete", study_id)
    assert refused.returncode == 2 and "409" in refused.stderr
    # its place in the fleet changes while it runs
    updated = cli(service, "update", study_id, "--priority", "3", "--owner", "team-a")
    assert updated.returncode == 0, updated.stderr
    assert "priority 3 · owner team-a" in updated.stdout
    bad = cli(service, "update", study_id, "--priority", "0")
    assert bad.returncode == 2 and "priority" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1  # one line, no traceback
    listed = cli(service, "studies")
    assert any("team-a" in line for line in listed.stdout.splitlines() if study_id in line)
    cancelled = cli(service, "cancel", study_id)
    assert cancelled.returncode == 0 and "cancelled" in cancelled.stdout
    late = cli(service, "update", study_id, "--priority", "2")
    assert late.returncode == 2 and "409" in late.stderr
    deadline = time.monotonic() + 60
    while (deleted := cli(service, "delete", study_id)).returncode != 0:
        assert "still has packs training" in deleted.stderr  # they stop within seconds
        assert time.monotonic() < deadline
        time.sleep(0.3)
    assert f"study {study_id} deleted" in deleted.stdout
    with Client(service["url"]) as client, pytest.raises(ApiError):
        client.get_study(int(study_id))


def test_names_with_brackets_are_shown_as_they_are(service: dict[str, Any], tmp_path: Path) -> None:
    """A study's name and owner are the user's words, not rich markup: ``[/]`` in a name
    crashed ``packtune studies`` and ``show`` with a MarkupError traceback (no study could
    be listed until it was deleted), and ``[red]x[/red]`` lost its brackets."""
    with Client(service["url"], TOKEN) as client:
        study = client.create_study({**SPEC, "name": "a [/] b", "owner": "[red]ops[/red]"})
    listed = cli(service, "studies")
    assert listed.returncode == 0, listed.stderr
    assert "a [/] b" in listed.stdout and "[red]ops[/red]" in listed.stdout
    shown = cli(service, "show", str(study.id))
    assert shown.returncode == 0, shown.stderr
    assert f"study {study.id} a [/] b (digits-mlp)" in shown.stdout
    page = cli(service, "studies", "--limit", "1")
    assert page.returncode == 0, page.stderr
    assert re.search(r"studies 1-1 of \d+ \(--limit 0 lists all", " ".join(page.stdout.split()))


def test_a_file_that_cannot_be_written_is_one_line(service: dict[str, Any], tmp_path: Path) -> None:
    """``export --out`` and ``best --out`` to a missing folder or onto a folder: one line and
    exit 2, not a FileNotFoundError / IsADirectoryError traceback."""
    study = service["study"]
    for args in (("export", str(study.id), "--out", str(tmp_path / "nodir" / "x.csv")),
                 ("best", str(study.id), "--out", str(tmp_path))):  # fmt: skip
        done = cli(service, *args)
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        assert done.stderr.startswith("error: cannot write") and "Traceback" not in done.stderr
    # to standard output on a full disk: each was a traceback (OSError: ENOSPC)
    for args in (("export", str(study.id)), ("studies",), ("show", str(study.id))):
        with open("/dev/full", "w") as full:
            done = subprocess.run(
                [sys.executable, "-m", "service", *args, "--url", service["url"]],
                env=service["env"], stdout=full, stderr=subprocess.PIPE, text=True, timeout=300,
            )  # fmt: skip
        assert done.returncode == 2, (args, done.stderr)
        assert done.stderr.strip().splitlines() == [
            "error: cannot write to standard output: No space left on device"
        ], (args, done.stderr)


class _NotPacktune(BaseHTTPRequestHandler):
    """A login page, or a proxy's redirect to https: what a wrong --url may answer."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path.startswith("/moved"):
            self.send_response(301)
            self.send_header("Location", "https://example.invalid/")
            self.end_headers()
            return
        body = b"<html><body>please log in</body></html>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def test_an_answer_that_is_not_packtunes_is_one_line(service: dict[str, Any]) -> None:
    server = HTTPServer(("127.0.0.1", 0), _NotPacktune)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        for url, says in ((base, "not JSON"), (f"{base}/moved", "redirected to https://")):
            done = subprocess.run(
                [sys.executable, "-m", "service", "studies", "--url", url],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert done.returncode == 2, (url, done.stdout, done.stderr)
            assert says in done.stderr and "Traceback" not in done.stderr, done.stderr
    finally:
        server.shutdown()


def test_a_get_waits_out_a_service_that_is_away_for_a_while() -> None:
    """Polling a study through a restart or a database away for a few seconds (503) goes on;
    before, the first 503 ended ``Client.wait`` (and ``submit --watch``)."""
    answers = iter([200, 503, 503, 200])
    body = {"id": 1, "name": "s", "workload": "w", "status": "completed",
            "objective": {"metric": "val_loss", "mode": "min"}}  # fmt: skip

    def handle(request: httpx.Request) -> httpx.Response:
        code = next(answers)
        if code == 503:
            return httpx.Response(503, json={"detail": "the database is unavailable"})
        return httpx.Response(200, json=body)

    with Client("http://packtune.invalid", transport=httpx.MockTransport(handle)) as client:
        assert client.get_study(1).status == "completed"
        assert client.wait(1, poll=0.01).status == "completed"


def test_a_check_no_worker_takes_gives_up_saying_so() -> None:
    """A check stays queued where no worker runs: ``Client.check`` polled it for ever."""

    def handle(request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            return httpx.Response(202, json={"id": 1, "status": "queued"},
                                  headers={"Location": "/api/workloads/checks/1"})  # fmt: skip
        return httpx.Response(200, json={"id": 1, "status": "queued"})

    with Client("http://packtune.invalid", transport=httpx.MockTransport(handle)) as client:
        with pytest.raises(TimeoutError, match="is a worker running"):
            client.check("digits-mlp", poll=0.01, timeout=0.1)
