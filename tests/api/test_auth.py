"""Auth and code execution, against a live ``packtune serve`` with ``PACKTUNE_API_TOKEN`` set.

- every POST needs ``Authorization: Bearer <token>``; without it, or with any
  other token, 401 and nothing is stored; every GET stays open;
- the token is compared with ``secrets.compare_digest`` (constant time);
- a workload named by a module or dotted path, or a file, is refused 422:
  only registered workloads run, and the named module is never imported.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from service.api import deps
from tests.support.processes import http, packtune_env, serving

TOKEN = "s3cret-t0ken-for-tests"
SPEC: dict[str, Any] = {
    "name": "auth",
    "workload": "digits-mlp",
    "space": {"lr": {"type": "loguniform", "low": 0.001, "high": 0.3}},
    "hyperband": {"max_resource": 3, "eta": 3},
}
# A module a client might try to have the service import; it leaves a mark if imported.
BAIT = """
import pathlib
pathlib.Path(__file__).with_name("IMPORTED").write_text("the service imported me")


class Evil:
    name = "evil"
"""


@pytest.fixture(scope="module")
def bait(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("bait")
    (folder / "packtune_bait.py").write_text(BAIT)
    return folder


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, bait: Path) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("auth")
    env = packtune_env(database_url=f"sqlite:///{tmp / 'packtune.db'}", api_token=TOKEN)
    env["PYTHONPATH"] = str(bait)  # the bait is importable by the server, were it to try
    with serving(env, tmp / "serve.log", "--no-scheduler") as url:
        yield url


def count(live: str) -> int:
    return int(http.get(f"{live}/api/studies", timeout=10).json()["count"])


BAD_CREDENTIALS = {
    "none": {},
    "bearer alone": {"Authorization": "Bearer"},
    "wrong token": {"Authorization": "Bearer s3cret-t0ken-for-tesTs"},
    "a prefix": {"Authorization": f"Bearer {TOKEN[:-1]}"},
    "longer": {"Authorization": f"Bearer {TOKEN}x"},
    "basic scheme": {"Authorization": f"Basic {TOKEN}"},
    "no scheme": {"Authorization": TOKEN},
    "as a query parameter": {},  # ?token=... is not a credential
}


@pytest.mark.parametrize("how", list(BAD_CREDENTIALS))
def test_writes_without_the_token_are_401(live: str, how: str) -> None:
    params = {"token": TOKEN} if how == "as a query parameter" else None
    before = count(live)
    headers = BAD_CREDENTIALS[how]
    created = http.post(
        f"{live}/api/studies", json=SPEC, headers=headers, params=params, timeout=30
    )
    assert created.status_code == 401, created.text
    assert created.headers["www-authenticate"] == "Bearer"
    assert created.json()["detail"] == "missing or wrong bearer token"
    cancel = http.post(f"{live}/api/studies/1/cancel", headers=headers, timeout=30)
    assert cancel.status_code == 401  # refused before the study is even looked up
    assert count(live) == before


def test_a_body_is_not_judged_before_the_token(live: str) -> None:
    """Issue: malformed JSON without a token was a 422 (the body was parsed first). Without
    the token any write is a 401, whatever its body; with it, the body is judged."""
    bodies = [b"{not json", b'{"name": 1}', b"x" * 100]
    for body in bodies:
        refused = http.post(f"{live}/api/studies", content=body, timeout=30,
                             headers={"Content-Type": "application/json"})  # fmt: skip
        assert refused.status_code == 401, (body, refused.text)
    judged = http.post(
        f"{live}/api/studies", content=b"{not json", timeout=30,
        headers={"Content-Type": "application/json", "Authorization": f"bearer {TOKEN}"},
    )  # fmt: skip
    assert judged.status_code == 422


def test_the_token_opens_writes_and_reads_stay_open(live: str) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    created = http.post(f"{live}/api/studies", json=SPEC, headers=auth, timeout=30)
    assert created.status_code == 201, created.text
    study_id = created.json()["id"]
    for path in (
        "/api/studies", f"/api/studies/{study_id}", f"/api/studies/{study_id}/trials",
        f"/api/studies/{study_id}/brackets", f"/api/studies/{study_id}/packs",
        f"/api/studies/{study_id}/curves", f"/api/studies/{study_id}/leaderboard",
        "/api/workers", "/api/workloads", "/healthz", "/metrics", "/openapi.json",
    ):  # fmt: skip
        assert http.get(f"{live}{path}", timeout=30).status_code == 200, path
    cancelled = http.post(f"{live}/api/studies/{study_id}/cancel", headers=auth, timeout=30)
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"


def test_the_token_is_compared_in_constant_time() -> None:
    """``require_token`` compares with ``secrets.compare_digest`` and never with ``==``."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(deps.require_token)))
    calls = {ast.unparse(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    assert "secrets.compare_digest" in calls
    compares = [node for node in ast.walk(tree) if isinstance(node, ast.Compare)]
    assert all(isinstance(op, ast.Is | ast.IsNot) for node in compares for op in node.ops), [
        ast.unparse(node) for node in compares
    ]


WORKLOADS = [
    "packtune_bait",
    "packtune_bait:Evil",
    "packtune_bait.Evil",
    "worker.workloads.digits:DigitsMLP",
    "worker.workloads.digits.DigitsMLP",
    "os:system",
    "__import__('packtune_bait')",
    "/tmp/packtune_bait.py",
    "file:///tmp/packtune_bait.py",
]


@pytest.mark.parametrize("workload", WORKLOADS)
def test_a_workload_given_as_code_is_refused_and_never_imported(
    live: str, bait: Path, workload: str
) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    before = count(live)
    response = http.post(
        f"{live}/api/studies", json={**SPEC, "workload": workload}, headers=auth, timeout=30
    )
    assert response.status_code == 422, response.text
    (entry,) = response.json()["detail"]
    assert entry["loc"] == ["body", "workload"] and "unknown workload" in entry["msg"]
    assert count(live) == before
    assert not (bait / "IMPORTED").exists(), "the service imported a module a client named"


def test_the_registry_never_imports_a_name(bait: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the scheduler and workers call with a stored study's workload name."""
    from packtune.workloads import get_workload

    monkeypatch.syspath_prepend(str(bait))
    for workload in WORKLOADS:
        with pytest.raises(KeyError, match="unknown workload"):
            get_workload(workload)
    assert not (bait / "IMPORTED").exists()


def test_an_empty_token_is_no_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """``PACKTUNE_API_TOKEN=`` (compose writes it so for the services that do not check it)
    was a token of its own: writes needed ``Bearer`` and nothing, which the client never
    sends, so every write from the CLI was a 401; unset, the API is open, as documented."""
    from packtune.settings import load_settings

    monkeypatch.setenv("PACKTUNE_API_TOKEN", "")
    assert load_settings().api_token is None
    monkeypatch.setenv("PACKTUNE_API_TOKEN", TOKEN)
    token = load_settings().api_token
    assert token is not None and token.get_secret_value() == TOKEN
