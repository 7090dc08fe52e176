"""A Python client of a packtune service's REST API (on httpx).

Everything the CLI's remote commands do goes through here (one code path)::

    from packtune import Client

    with Client("http://127.0.0.1:8000") as client:
        study = client.create_study("examples/digits-mlp.yaml")
        study = client.wait(study, progress=True)
        model, config = client.best_model(study)

It needs no torch except for :meth:`Client.best_model` (which builds the model) and no
pandas except for :meth:`Client.trials_dataframe`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from packtune.settings import token_problem

if TYPE_CHECKING:
    import pandas
    from torch import nn

#: statuses after which a study changes no more
FINISHED = ("completed", "failed", "cancelled")
#: seconds a GET waits out a service that answered before and is away (a restart)
RETRY_SECONDS = 60.0
#: studies per request when listing them all
STUDY_PAGE = 500
#: the columns of :meth:`Trial.flat` every trial has, in its order (``config.<name>`` and
#: ``metric.<name>`` follow): a CSV of a study without trials is these alone
FLAT_COLUMNS = ("id", "status", "iteration", "bracket", "rung", "resource",
                "measured_resource", "error")  # fmt: skip


class ApiError(Exception):
    """The service answered with an error: ``status_code`` and its ``detail`` (for a 422,
    the fields at fault, ``"space.lr.low: ..."``)."""

    def __init__(self, status_code: int, detail: str) -> None:
        self.status_code, self.detail = status_code, detail
        super().__init__(f"{status_code}: {detail}")


@dataclass(frozen=True)
class Trial:
    """One trial as the API shows it: its config, where it is, its latest metrics."""

    id: int
    status: str
    config: dict[str, Any]
    bracket: int
    rung: int
    resource: float
    measured_resource: float | None
    metrics: dict[str, Any]
    error: str | None
    raw: dict[str, Any] = field(repr=False, compare=False)
    #: the Hyperband iteration it was sampled in (a study with a budget runs several)
    iteration: int = 0

    def flat(self) -> dict[str, Any]:
        """One flat row: id, status, iteration, bracket, rung, ``resource`` (how far it
        trained, as the API's and the JSON export's ``resource``), ``measured_resource``
        (where its metrics are from), ``error`` (why it failed or diverged), then
        ``config.<name>`` and ``metric.<name>`` (a dataframe's or a CSV file's)."""
        return {
            "id": self.id, "status": self.status, "iteration": self.iteration,
            "bracket": self.bracket, "rung": self.rung, "resource": self.resource,
            "measured_resource": self.measured_resource, "error": self.error,
            **{f"config.{k}": v for k, v in sorted(self.config.items())},
            **{f"metric.{k}": v for k, v in sorted(self.metrics.items())},
        }  # fmt: skip

    @classmethod
    def of(cls, row: Mapping[str, Any]) -> Trial:
        return cls(
            id=int(row["id"]), status=str(row["status"]), config=dict(row["config"]),
            bracket=int(row.get("bracket", 0)), rung=int(row.get("rung", 0)),
            resource=float(row.get("resource", 0.0)),
            measured_resource=row.get("measured_resource"), metrics=dict(row["metrics"]),
            error=row.get("error"), raw=dict(row), iteration=int(row.get("iteration", 0)),
        )  # fmt: skip


@dataclass(frozen=True)
class Study:
    """A study's summary: status, progress (units done of the total), best trial.

    ``failed_trials`` says how many of its trials failed; ``progress``'s done counts each
    one's last unit as finished (not trained), so that the bar reaches its total however
    its trials end."""

    id: int
    name: str
    workload: str
    status: str
    metric: str
    mode: str
    progress: tuple[int, int]
    best_trial_id: int | None
    best_metrics: dict[str, Any] | None
    error: str | None
    raw: dict[str, Any] = field(repr=False, compare=False)
    #: its weight in the fair share of device time, owner label, and share now (while running)
    priority: float = 1.0
    owner: str | None = None
    share: float | None = None
    failed_trials: int = 0

    @classmethod
    def of(cls, row: Mapping[str, Any]) -> Study:
        best = row.get("best_trial")
        progress = row.get("progress") or {}
        fleet = row.get("fleet") or {}
        return cls(
            id=int(row["id"]), name=str(row["name"]), workload=str(row["workload"]),
            status=str(row["status"]), metric=str(row["objective"]["metric"]),
            mode=str(row["objective"]["mode"]),
            progress=(int(progress.get("done", 0)), int(progress.get("total", 0))),
            best_trial_id=int(best["id"]) if best else None,
            best_metrics=dict(best["metrics"]) if best else None,
            error=row.get("error"), raw=dict(row),
            priority=float(fleet.get("priority", 1.0)), owner=fleet.get("owner"),
            share=fleet.get("share"), failed_trials=int(progress.get("failed", 0)),
        )  # fmt: skip

    @property
    def finished(self) -> bool:
        return self.status in FINISHED


def _detail(resp: httpx.Response) -> str:
    """What an error answer says, on one line: the API's ``detail``; another server's page
    (a proxy's error, a URL that is not packtune's) is named, not printed line by line."""
    try:
        body = resp.json()
    except ValueError:
        text = " ".join(resp.text.split())
        if text.startswith("<") or "html" in resp.headers.get("content-type", ""):
            return (
                f"{resp.reason_phrase or 'error'} (an HTML page, not packtune's answer: is "
                f"{resp.url.copy_with(path='/', query=None)} a packtune service?)"
            )
        return text[:200] or resp.reason_phrase
    detail = body.get("detail") if isinstance(body, dict) else body
    if detail is None:
        return resp.reason_phrase
    if isinstance(detail, list):  # FastAPI's 422: where, and what is wrong there
        detail = "; ".join(
            f"{'.'.join(str(p) for p in d.get('loc', [])[1:])}: {d.get('msg')}"
            if isinstance(d, dict)
            else str(d)
            for d in detail
        )
    return " ".join(str(detail).split())


def _id(study: int | Study) -> int:
    return study.id if isinstance(study, Study) else int(study)


def load_spec(spec: Mapping[str, Any] | str | Path) -> dict[str, Any]:
    """A study spec from a mapping, or a YAML or JSON file's path."""
    if isinstance(spec, Mapping):
        return dict(spec)
    import yaml

    loaded = yaml.safe_load(Path(spec).read_text())
    if not isinstance(loaded, dict):
        raise ValueError(f"{spec}: a study spec must be a mapping")
    return loaded


class Client:
    """A packtune service at ``url``; ``token``: the bearer token its writes need.

    Args:
        url: the service's base URL.
        token: ``PACKTUNE_API_TOKEN`` of the service, if it sets one.
        timeout: seconds per request.
        transport: an httpx transport (tests).

    Raises:
        ApiError: on every call the service refuses (its status code and ``detail``);
        ``httpx.HTTPError`` when it cannot be reached.

    Example:
        >>> with Client("http://127.0.0.1:8000") as client:  # doctest: +SKIP
        ...     best = client.leaderboard(client.studies()[0], limit=1)
    """

    def __init__(
        self,
        url: str = "http://127.0.0.1:8000",
        token: str | None = None,
        *,
        timeout: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if token and (problem := token_problem(token)) is not None:
            raise ValueError(f"token: {problem}")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.url = url.rstrip("/")
        #: a request was answered: a later lost connection is a restart, worth waiting out
        self._answered = False
        self.http = httpx.Client(
            base_url=self.url, headers=headers, timeout=timeout, transport=transport
        )

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    def _call(self, method: str, path: str, *, raw: bool = False, **kwargs: Any) -> httpx.Response:
        """One request; an error status, a redirect, or (unless ``raw``) a body that is not
        JSON raise :class:`ApiError`. A GET of a service that answered before is tried again
        on a lost connection or a 502/503/504 (a restart, a database away for a while), for
        up to :data:`RETRY_SECONDS`."""
        deadline = time.monotonic() + RETRY_SECONDS
        wait = 0.25
        while True:
            try:
                resp = self.http.request(method, path, **kwargs)
            except httpx.TransportError:
                if method != "GET" or not self._answered or time.monotonic() > deadline:
                    raise
            else:
                transient = resp.status_code in (502, 503, 504) and method == "GET"
                if not transient or time.monotonic() > deadline:
                    break
            time.sleep(wait)
            wait = min(2 * wait, 5.0)
        if resp.status_code >= 400:
            raise ApiError(resp.status_code, _detail(resp))
        if 300 <= resp.status_code < 400:
            where = resp.headers.get("location", "elsewhere")
            raise ApiError(resp.status_code, f"redirected to {where}: use that URL")
        kind = resp.headers.get("content-type", "")
        if not raw and resp.status_code != 204 and "json" not in kind:
            raise ApiError(
                resp.status_code,
                f"{resp.url} answered {kind or 'with no content type'}, not JSON: "
                "is it a packtune service?",
            )
        self._answered = True
        return resp

    # -- studies ----------------------------------------------------------------------------

    def create_study(self, spec: Mapping[str, Any] | str | Path) -> Study:
        """Submit a study (a spec mapping, or a YAML/JSON file); it starts at once."""
        return Study.of(self._call("POST", "/api/studies", json=load_spec(spec)).json())

    def get_study(self, study: int | Study) -> Study:
        return Study.of(self._call("GET", f"/api/studies/{_id(study)}").json())

    def studies(
        self, status: str | list[str] | None = None, limit: int | None = 100, offset: int = 0
    ) -> list[Study]:
        """Studies, newest first, from the ``offset``-th; ``status`` keeps those in it (one or
        several); ``limit`` None: all of them (fetched a page at a time)."""
        return self.studies_page(status, limit, offset)[0]

    def studies_page(
        self, status: str | list[str] | None = None, limit: int | None = 100, offset: int = 0
    ) -> tuple[list[Study], int]:
        """:meth:`studies`, and how many studies match in all."""
        out: list[Study] = []
        while True:
            page = STUDY_PAGE if limit is None else min(STUDY_PAGE, limit - len(out))
            params: dict[str, Any] = {"limit": page, "offset": offset + len(out)}
            if status is not None:
                params["status"] = [status] if isinstance(status, str) else list(status)
            body = self._call("GET", "/api/studies", params=params).json()
            out += [Study.of(row) for row in body["data"]]
            count = int(body["count"])
            if not body["data"] or offset + len(out) >= count or len(out) == limit:
                return out, count

    def wait(
        self,
        study: int | Study,
        *,
        progress: bool = False,
        poll: float = 1.0,
        timeout: float | None = None,
    ) -> Study:
        """Wait until the study is completed, failed or cancelled; ``progress`` shows a
        progress bar (rich). Raises ``TimeoutError`` after ``timeout`` seconds."""
        study_id = _id(study)
        deadline = None if timeout is None else time.monotonic() + timeout
        if progress:
            from packtune.progress import watch

            def fetch() -> dict[str, Any]:
                summary = dict(self.get_study(study_id).raw)
                top = self.leaderboard(study_id, limit=1)
                summary["best_so_far"] = top[0].raw if top else None
                return summary

            found = Study.of(watch(fetch, interval=poll, until=_past(deadline)))
            if not found.finished:
                raise TimeoutError(f"study {study_id} is still {found.status}")
            return found
        while not (found := self.get_study(study_id)).finished:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"study {study_id} is still {found.status}")
            time.sleep(poll)
        return found

    def cancel(self, study: int | Study) -> Study:
        return Study.of(self._call("POST", f"/api/studies/{_id(study)}/cancel").json())

    def update(
        self, study: int | Study, *, priority: float | None = None, owner: str | None = None
    ) -> Study:
        """Change a running study's ``priority`` (its share of device time against the other
        running studies) or ``owner`` label.

        Raises:
            ApiError: a bad value (422), an unknown study (404), or a finished one (409).
            ValueError: a priority that is not a finite number (JSON has none to send).
        """
        if priority is not None and not math.isfinite(priority):
            raise ValueError(f"priority must be a finite number, not {priority!r}")
        body = {k: v for k, v in (("priority", priority), ("owner", owner)) if v is not None}
        return Study.of(self._call("PATCH", f"/api/studies/{_id(study)}", json=body).json())

    def delete(self, study: int | Study) -> None:
        """Delete a finished, failed or cancelled study with its checkpoints."""
        self._call("DELETE", f"/api/studies/{_id(study)}")

    # -- workloads --------------------------------------------------------------------------

    def check(
        self,
        workload: str,
        space: Mapping[str, Any] | None = None,
        *,
        members: int = 4,
        steps: int = 5,
        poll: float = 0.5,
        timeout: float | None = 600.0,
    ) -> dict[str, Any]:
        """``packtune check`` on one of the service's workers: how ``workload`` fuses (see
        ``POST /api/workloads/{name}/check``). Returns the check (``status`` ``passed``,
        ``failed`` or ``error``, and its ``report``). Raises ``TimeoutError`` when no worker
        has finished it within ``timeout`` seconds (None: wait for ever)."""
        body = {"space": dict(space) if space is not None else None, "members": members,
                "steps": steps}  # fmt: skip
        resp = self._call("POST", f"/api/workloads/{workload}/check", json=body)
        location = resp.headers["Location"]
        deadline = None if timeout is None else time.monotonic() + timeout
        while (found := self._call("GET", location).json())["status"] in ("queued", "running"):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(
                    f"check of {workload} still {found['status']} after {timeout:g} s: "
                    "is a worker running?"
                )
            time.sleep(poll)
        return dict(found)

    # -- trials -----------------------------------------------------------------------------

    def trials(self, study: int | Study, status: str | None = None) -> list[Trial]:
        params = {"status": status} if status is not None else {}
        rows = self._call("GET", f"/api/studies/{_id(study)}/trials", params=params).json()
        return [Trial.of(row) for row in rows["data"]]

    def leaderboard(self, study: int | Study, limit: int | None = None) -> list[Trial]:
        """Measured trials, best first (furthest trained, then by the objective)."""
        params = {"limit": limit} if limit is not None else {}
        rows = self._call("GET", f"/api/studies/{_id(study)}/leaderboard", params=params)
        return [Trial.of(row) for row in rows.json()["data"]]

    def trials_dataframe(self, study: int | Study) -> pandas.DataFrame:
        """One row per trial: id, status, bracket, rung, resource, ``config.<name>`` and
        ``metric.<name>`` columns. Needs pandas (``pip install pandas``)."""
        try:
            import pandas
        except ImportError:
            raise ImportError("trials_dataframe needs pandas: pip install pandas") from None
        rows = [t.flat() for t in self.trials(study)]
        return pandas.DataFrame(rows)

    def checkpoint(self, study: int | Study, trial: int | Trial) -> bytes:
        """A trial's latest checkpoint, as ``torch.save`` wrote it."""
        trial_id = trial.id if isinstance(trial, Trial) else int(trial)
        path = f"/api/studies/{_id(study)}/trials/{trial_id}/checkpoint"
        return self._call("GET", path, raw=True).content

    def best_model(self, study: int | Study) -> tuple[nn.Module, dict[str, Any]]:
        """The study's best trial as a ready model (eval mode) and its config: its checkpoint
        downloaded and loaded into the workload's model, built here (the workload must be
        installed where this runs). Raises ``ApiError`` (404) while no trial is best."""
        import io

        import torch

        from packtune.workloads import get_workload

        found = study if isinstance(study, Study) else self.get_study(study)
        if found.best_trial_id is None:
            raise ApiError(404, f"study {found.id} has no best trial yet ({found.status})")
        state = torch.load(
            io.BytesIO(self.checkpoint(found, found.best_trial_id)), weights_only=True
        )
        config = dict(state["config"])
        model = get_workload(found.workload).build_model(config)
        model.load_state_dict({**state["params"], **state["buffers"]})
        return model.eval(), config


def _past(deadline: float | None) -> Callable[[], bool] | None:
    if deadline is None:
        return None
    return lambda: time.monotonic() > deadline
