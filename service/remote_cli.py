"""The CLI's commands for a running service, all on :class:`packtune.client.Client`:
``submit``, ``studies``, ``show``, ``cancel``, ``delete``, ``export``, ``best``.

A refusal of the service is one line (its status and ``detail``) and exit 2; so is a
service that cannot be reached.
"""

from __future__ import annotations

import csv
import io
import json
import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, NoReturn

import typer

if TYPE_CHECKING:  # imported when a command runs: `packtune run` loads no HTTP client
    from packtune.client import Client, Study

Url = Annotated[str, typer.Option(envvar="PACKTUNE_URL", help="The service's base URL.")]
Token = Annotated[
    str | None, typer.Option(envvar="PACKTUNE_API_TOKEN", help="Bearer token (writes).")
]
StudyId = Annotated[int, typer.Argument(min=1, help="The study's id.")]
DEFAULT_URL = "http://127.0.0.1:8000"


def _fail(message: str) -> NoReturn:
    from service.cli import fail

    fail(message)


def _need_stdout(what: str) -> None:
    from service.cli import need_stdout

    need_stdout(what)


@contextmanager
def connected(url: str, token: str | None) -> Iterator[Client]:
    """A client of ``url``; the service's refusals and an unreachable service end the
    command with one line."""
    import httpx

    from packtune.client import ApiError, Client
    from packtune.settings import token_problem

    if token and (problem := token_problem(token)) is not None:
        _fail(f"the token (--token, PACKTUNE_API_TOKEN) {problem}")
    try:
        with Client(url, token) as client:
            yield client
    except ApiError as exc:
        _fail(str(exc))
    except httpx.InvalidURL as exc:
        _fail(f"not a URL packtune can reach: {url!r} ({exc})")
    except httpx.HTTPError as exc:
        _fail(f"cannot reach {url}: {exc}")
    except TimeoutError as exc:
        _fail(str(exc))
    except (KeyError, ValueError, TypeError) as exc:  # JSON, but not a packtune answer
        _fail(f"unexpected answer from {url} ({type(exc).__name__}: {exc}): is it packtune?")


def _line(study: Study) -> str:
    from packtune.progress import failed_text

    done, total = study.progress
    best = ""
    if study.best_metrics is not None:
        best = f", best trial {study.best_trial_id} {study.metric}="
        value = study.best_metrics.get(study.metric)
        best += f"{value:.4g}" if isinstance(value, int | float) else "?"
    head = f"study {study.id} {study.name} ({study.workload})"
    failed = failed_text(study.failed_trials)
    return f"{head}: {study.status}, {done}/{total} units{failed}{best}"


def register(app: typer.Typer) -> None:
    """Add the remote commands to ``app``."""

    @app.command()
    def submit(
        spec: Annotated[Path, typer.Argument(help="Study spec (YAML or JSON).")],
        url: Url = DEFAULT_URL,
        watch_: Annotated[bool, typer.Option("--watch", help="Follow its progress.")] = False,
        token: Token = None,
    ) -> None:
        """Submit a study to a running service."""
        _need_stdout("the study")
        from packtune.progress import error_lines, leaderboard_table, output_console
        from service.cli import read_spec_file

        # validated by the service, against the workloads installed there: a plugin may be
        # installed on the GPU box only (and loading this machine's plugins imports torch)
        body = read_spec_file(spec)
        if not isinstance(body, dict):
            _fail(f"{spec}: a study spec is a mapping (name, workload, space, ...)")
        try:
            json.dumps(body)
        except (TypeError, ValueError) as exc:  # e.g. YAML read an unquoted 2026-01-01 as a date
            _fail(f"{spec}: {exc}; quote the value")
        with connected(url, token) as client:
            study = client.create_study(body)
            console = output_console()
            console.print(escape(f"study {study.id} submitted: {client.url}/#/studies/{study.id}"))
            if not watch_:
                return
            study = client.wait(study, progress=True, poll=0.5)
            rows = [t.raw for t in client.leaderboard(study)]
            console.print(leaderboard_table(rows, study.metric))
            troubled = client.trials(study, status="failed") + client.trials(study, "diverged")
            for line in error_lines([t.raw for t in troubled]):
                console.print(f"[red]{escape(line)}[/]")
            if study.error:
                console.print(f"[red]study {study.id} failed: {escape(study.error)}[/]")
            console.print(f"study {study.id} {study.status}")
        if study.status != "completed":
            raise typer.Exit(1)  # as packtune run: a script sees a study that did not end well

    @app.command()
    def studies(
        status: Annotated[
            list[str] | None, typer.Option(help="Only studies in this status (repeatable).")
        ] = None,
        limit: Annotated[int, typer.Option(min=0, help="Most studies to list (0: all).")] = 100,
        offset: Annotated[int, typer.Option(min=0, help="Skip the newest this many.")] = 0,
        url: Url = DEFAULT_URL,
        token: Token = None,
    ) -> None:
        """The service's studies, newest first."""
        _need_stdout("the studies")
        from rich.table import Table

        from packtune.progress import failed_text, output_console

        with connected(url, token) as client:
            rows, count = client.studies_page(status, limit or None, offset)
        table = Table("id", "name", "workload", "status", "units", "best", "share", "owner")
        for study in rows:
            done, total = study.progress
            value = (study.best_metrics or {}).get(study.metric)
            shown = f"{study.metric}={value:.4g}" if isinstance(value, int | float) else "-"
            share = f"{study.share:.0%}" if study.share is not None else "-"
            units = f"{done}/{total}{failed_text(study.failed_trials, markup=True)}"
            table.add_row(str(study.id), escape(study.name), escape(study.workload),
                          study.status, units, escape(shown), share,
                          escape(study.owner or "-"))  # fmt: skip
        console = output_console()
        console.print(table)
        if not rows and offset > 0:  # past the last: it said "studies 50-50 of 4"
            console.print(f"no studies at offset {offset} of {count}")
        elif offset + len(rows) < count or offset > 0:
            console.print(
                f"studies {offset + 1}-{offset + len(rows)} of {count} "
                "(--limit 0 lists all; --offset skips the newest)"
            )

    @app.command()
    def show(study_id: StudyId, url: Url = DEFAULT_URL, token: Token = None) -> None:
        """One study: status, progress, best trial and the top of its leaderboard."""
        _need_stdout("the study")
        from packtune.progress import leaderboard_table, output_console

        with connected(url, token) as client:
            study = client.get_study(study_id)
            top = [t.raw for t in client.leaderboard(study, limit=5)]
        console = output_console()
        console.print(escape(_line(study)))
        if study.error:
            console.print(escape(f"error: {study.error}"))
        if top:
            console.print(leaderboard_table(top, study.metric, limit=5))

    @app.command()
    def cancel(study_id: StudyId, url: Url = DEFAULT_URL, token: Token = None) -> None:
        """Cancel a pending or running study (its running packs stop within seconds)."""
        with connected(url, token) as client:
            typer.echo(_line(client.cancel(study_id)))

    @app.command()
    def update(
        study_id: StudyId,
        priority: Annotated[
            float | None, typer.Option(help="Its weight in the fair share of device time.")
        ] = None,
        owner: Annotated[str | None, typer.Option(help="A user or team label.")] = None,
        url: Url = DEFAULT_URL,
        token: Token = None,
    ) -> None:
        """Change a pending or running study's priority or owner (used from the next tick)."""
        if priority is not None and not math.isfinite(priority):
            _fail(f"--priority must be a finite number, not {priority}")
        with connected(url, token) as client:
            study = client.update(study_id, priority=priority, owner=owner)
        typer.echo(f"{_line(study)} · priority {study.priority:g}"
                   + (f" · owner {study.owner}" if study.owner else ""))  # fmt: skip

    @app.command()
    def delete(study_id: StudyId, url: Url = DEFAULT_URL, token: Token = None) -> None:
        """Delete a finished, failed or cancelled study with its checkpoints."""
        with connected(url, token) as client:
            client.delete(study_id)
        typer.echo(f"study {study_id} deleted")

    @app.command()
    def export(
        study_id: StudyId,
        format_: Annotated[
            Literal["csv", "json"], typer.Option("--format", help="csv or json.")
        ] = "csv",
        out: Annotated[Path | None, typer.Option(help="File to write (default: stdout).")] = None,
        url: Url = DEFAULT_URL,
        token: Token = None,
    ) -> None:
        """A study's trials, as CSV or JSON.

        Each trial's id, status, bracket, rung, resource trained, measured_resource (where
        its metrics are from), config values and latest metrics (CSV columns config.NAME and
        metric.NAME)."""
        if out is None:
            _need_stdout("the trials (--out FILE writes them)")
        with connected(url, token) as client:
            trials = client.trials(study_id)
        text = _as_json(trials) if format_ == "json" else _as_csv(trials)
        if out is None:
            _to_stdout(text)
        else:
            _write(out, text.encode())
            typer.echo(f"{len(trials)} trials of study {study_id} written to {out}")

    @app.command()
    def best(
        study_id: StudyId,
        out: Annotated[Path, typer.Option(help="Where to write the checkpoint.")] = Path(
            "model.pt"
        ),
        url: Url = DEFAULT_URL,
        token: Token = None,
    ) -> None:
        """Download the best trial's checkpoint.

        Load it with packtune.Client.best_model, or torch.load(OUT, weights_only=True) and
        the workload's build_model."""
        with connected(url, token) as client:
            study = client.get_study(study_id)
            if study.best_trial_id is None:
                _fail(f"study {study_id} has no best trial ({study.status})")
            data = client.checkpoint(study, study.best_trial_id)  # type: ignore[arg-type]
        _write(out, data)
        typer.echo(f"trial {study.best_trial_id} of study {study_id} written to {out}")


def _to_stdout(text: str) -> None:
    """``text`` to standard output, flushed now: one that cannot take it (a full disk) is
    then one line and exit 2 (:func:`service.cli.main`), as ``--out``'s, not a traceback at
    the interpreter's exit."""
    sys.stdout.write(text)
    sys.stdout.flush()


def _write(out: Path, data: bytes) -> None:
    """``data`` to ``out``; a path that cannot be written is one line and exit 2."""
    try:
        out.write_bytes(data)
    except OSError as exc:
        _fail(f"cannot write {out}: {exc.strerror or exc}")


def escape(text: str) -> str:
    """``text`` (a study's name, an error: the user's or the server's words) printed as it
    is, never read as rich markup: ``[/]`` in a name crashed the table."""
    from rich.markup import escape as rich_escape

    return rich_escape(text)


def _as_csv(trials: list[Any]) -> str:
    """A header row, then a row per trial: a study without trials (yet) is its header alone
    (it was a bare line end, no columns)."""
    from packtune.client import FLAT_COLUMNS

    rows = [t.flat() for t in trials]
    columns: dict[str, None] = dict.fromkeys(FLAT_COLUMNS)
    for row in rows:
        columns.update(dict.fromkeys(row))
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(columns))
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def _as_json(trials: list[Any]) -> str:
    return json.dumps([t.raw for t in trials], indent=2, default=str) + "\n"
