"""``packtune``: run | serve | scheduler | worker | submit | db upgrade.

User mistakes (a bad spec, a bad setting, an unreachable server) print one
line and exit non-zero; no stack traces.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
import yaml

from packtune.errors import DeviceUnavailable, PacktuneError, SpecError, StoreUnavailable
from packtune.settings import Settings, SettingsError, get_settings
from service import remote_cli

if TYPE_CHECKING:
    from sqlalchemy.orm import Session, sessionmaker

app = typer.Typer(
    name="packtune",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # docstrings as Markdown: a paragraph's wrapped lines join (the "rich" mode kept each
    # line break of the source, mid-sentence), `code` shows as code
    rich_markup_mode="markdown",
)
db_app = typer.Typer(help="Database commands.", no_args_is_help=True)
app.add_typer(db_app, name="db")


def _print_version(asked: bool) -> None:
    if asked:
        from importlib.metadata import version

        typer.echo(f"packtune {version('packtune')}")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """Pack-aware hyperparameter tuning: Hyperband with trials packed onto one device."""


def fail(message: str, code: int = 2) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def need_stdout(what: str) -> None:
    """Stop now, in one line, where standard output is closed (``>&-``: ``sys.stdout`` is
    None): a command that prints ``what`` crashed on it in a traceback, after its work was
    done (a study submitted, a check run)."""
    if sys.stdout is None:
        fail(f"standard output is closed: nothing could show {what}")


def _setup_logging() -> None:
    logging.basicConfig(
        level=get_settings().log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def _masked(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


class _SpecLoader(yaml.SafeLoader):
    """YAML 1.1 reads ``1e-6`` (no dot) as a string; a spec means the number. An integer
    too long for Python to read is a :class:`~packtune.spec_text.TooLong` (it was a
    traceback), which :func:`read_spec_file` names."""


def _int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> Any:
    from packtune.spec_text import TooLong

    try:
        return loader.construct_yaml_int(node)
    except ValueError:
        return TooLong(sum(c.isdigit() for c in str(node.value)))


_SpecLoader.add_constructor("tag:yaml.org,2002:int", _int)


_SpecLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def load_spec_file(path: Path) -> dict[str, Any]:
    """Read and validate a YAML/JSON spec; one-line error and exit 2 when it is wrong."""
    from packtune.spec import validate_spec

    raw = read_spec_file(path)
    try:
        return validate_spec(raw).model_dump(mode="json")
    except SpecError as exc:
        fail(f"{path}: {exc.field}: {exc.message}")


def read_spec_file(path: Path) -> Any:
    """A YAML/JSON spec as written, not validated (a service validates what it is sent,
    against its own workloads); one-line error and exit 2 when it cannot be read."""
    from packtune.spec_text import check_readable, loads_json

    try:
        text = path.read_text(encoding="utf-8")
        raw = loads_json(text) if path.suffix == ".json" else yaml.load(text, Loader=_SpecLoader)
        check_readable(raw)
    except SpecError as exc:
        fail(f"{path}: {exc.field}: {exc.message}")
    except json.JSONDecodeError as exc:
        fail(f"{path}: not valid JSON: {exc}")
    except FileNotFoundError:
        fail(f"{path}: no such file")
    except (OSError, UnicodeDecodeError) as exc:
        fail(f"{path}: cannot read: {exc}")
    except yaml.YAMLError as exc:
        fail(f"{path}: not valid YAML: {str(exc).splitlines()[0]}")
    return raw


def _trains_here(settings: Settings) -> None:
    """Stop now, in one line, if this process's runner could not save checkpoints (its packs
    would fail after training, each a dozen times), as ``packtune worker`` does."""
    from worker.embedded import checkpoint_folder_problem

    problem = checkpoint_folder_problem(settings.checkpoint_dir)
    if problem is not None:
        raise SettingsError(problem)


#: the most rows ``packtune run --top`` prints (a larger one overflowed SQLite's LIMIT)
MAX_TOP = 1_000_000
#: the largest TCP port ``packtune serve --port`` can bind
MAX_PORT = 65535


def summary_reader(factory: sessionmaker[Session], study_id: int) -> Callable[[], dict[str, Any]]:
    """The study's summary with its best so far, read in transactions that take no write lock:
    one a Ctrl-C cuts short keeps its connection (the interrupt's traceback holds it) while
    the scheduler thread stops, and on SQLite a BEGIN IMMEDIATE left open made each of its
    writes wait 30 s."""
    from service.db import read_only, session_scope
    from service.queries import study_summary

    reads = read_only(factory)

    def fetch() -> dict[str, Any]:
        with session_scope(reads) as s:
            return study_summary(s, study_id)

    return fetch


def in_thread(target: Callable[[], object]) -> threading.Event:
    """Run ``target`` in a daemon thread; the event is set when it returns or raises.

    Waited on instead of ``Thread.join``: a join that Ctrl-C interrupts while the thread
    lives marks it stopped (CPython 3.11's bpo-45274 clean-up in ``_wait_for_tstate_lock``
    releases the lock the living thread holds), so the next join returns at once. packtune
    run's scheduler.close() then stopped the study's clock while a tick still ran, and that
    tick's resume_studies started it again: the time the study sat stopped counted against
    its max_seconds (resumed later, it failed at serve's first tick)."""
    done = threading.Event()

    def run() -> None:
        try:
            target()
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    return done


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C's KeyboardInterrupt is."""


def _terminated(signum: int, frame: object) -> None:
    raise Terminated


@app.command()
def run(
    spec: Annotated[Path, typer.Argument(help="Study spec (YAML or JSON).")],
    top: Annotated[int, typer.Option(help="Rows of the leaderboard to print.")] = 10,
) -> None:
    """Run a study end to end here, its packs trained in a child process.

    Not by RQ workers: with PACKTUNE_REDIS_URL set (a deployment's) it refuses, as its own
    scheduler would take the deployment's packs for lost. The database is
    PACKTUNE_DATABASE_URL's: by default packtune.db, a SQLite file in the working directory;
    a PostgreSQL one works too."""
    from service.runtime import make_dispatcher, preload_sampler

    if not 0 <= top <= MAX_TOP:
        fail(f"--top must be 0 to {MAX_TOP:,}, not {top}")
    need_stdout("the study")
    # SIGTERM (kill, a service manager) ends it as Ctrl-C does: the runner stopped, the
    # study kept to be resumed, one line
    signal.signal(signal.SIGTERM, _terminated)
    body = load_spec_file(spec)
    settings = get_settings()
    if settings.redis_url:
        # a deployment's queue: its workers' packs, unknown to this run's own runner, would
        # look lost to this run's scheduler (re-queued, trained here); with no worker on
        # the queue, its packs waited for ever
        fail(
            "PACKTUNE_REDIS_URL is set: packtune run trains here, in its own process, not "
            "through a queue; unset it to run here, or give the study to that deployment "
            "with `packtune submit`"
        )
    _trains_here(settings)
    _setup_logging()
    logging.getLogger().setLevel(logging.WARNING)
    # the runner's start (spawn, torch, the workload's data: ~1.5 s on a CPU) is the first
    # pack's critical path: it overlaps everything that follows, this process's imports too
    dispatcher = make_dispatcher(settings)
    dispatcher.start(body["workload"])
    stop = threading.Event()
    unusable: list[str] = []  # the runner found no device to train on: stop, say why

    def device_check(warm_up: Future[str]) -> None:
        exc = None if warm_up.cancelled() else warm_up.exception()
        if isinstance(exc, DeviceUnavailable):
            unusable.append(str(exc))
            stop.set()

    for warm_up in getattr(dispatcher, "warm_ups", []):
        warm_up.add_done_callback(device_check)
    if body["sampler"]["name"] == "tpe":
        preload_sampler()
    try:
        from packtune.progress import error_lines, leaderboard_table, output_console, watch
        from service import store
        from service.db import get_sessionmaker, session_scope, upgrade
        from service.models import TrialStatus
        from service.queries import leaderboard, packs, trials
        from service.scheduler import Scheduler

        upgrade(settings.database_url)
        factory = get_sessionmaker()
        with session_scope(factory) as s:
            study = store.create_study(
                s, name=body["name"], workload=body["workload"], spec=body, seed=body["seed"]
            )
            study_id = study.id
        scheduler = Scheduler(settings, dispatcher=dispatcher)
    except BaseException:
        dispatcher.close()
        raise
    console = output_console()
    console.print(
        f"study {study_id} [bold]{remote_cli.escape(body['name'])}[/]: "
        f"{remote_cli.escape(body['workload'])}, database {_masked(settings.database_url)}"
    )

    started = time.monotonic()
    done = in_thread(lambda: scheduler.run(stop=stop, until_study=study_id))
    try:
        summary = watch(
            summary_reader(factory, study_id), console=console, until=done.is_set, sleep=done.wait
        )
    except KeyboardInterrupt as exc:
        stop.set()
        code = 143 if isinstance(exc, Terminated) else 130
        fail("interrupted; the study can be resumed with `packtune serve`", code)
    finally:
        stop.set()
        done.wait()
        scheduler.close()
    if unusable:
        fail(f"{unusable[0]} (study {study_id} is kept: `packtune serve` resumes it)")
    metric = body["objective"]["metric"]
    with session_scope(factory) as s:
        rows, _ = leaderboard(s, study_id, limit=top)
        _, n_packs = packs(s, study_id, limit=1)
    console.print(leaderboard_table(rows, metric, top))
    with session_scope(factory) as s:
        troubled = [
            row
            for status in (TrialStatus.failed, TrialStatus.diverged)
            for row in trials(s, study_id, status=status)[0]
        ]
    for line in error_lines(troubled):
        console.print(f"[red]{remote_cli.escape(line)}[/]")
    if summary.get("error"):
        console.print(f"[red]study {study_id} failed: {remote_cli.escape(summary['error'])}[/]")
    console.print(
        f"study {study_id} {summary['status']} in {time.monotonic() - started:.1f} s: "
        f"{units_line(summary)} in {n_packs} packs"
    )
    global _run_finished
    _run_finished = True
    if summary["status"] != "completed":
        raise typer.Exit(1)


def units_line(summary: dict[str, Any]) -> str:
    """The units of work ``run``'s last line names: a completed study's all trained, else
    how many of those planned were trained and how many failed (the progress bar's ``done``
    counts a failed unit as finished: "5 of 6" was said of a study none of whose trials
    trained a unit)."""
    progress = summary["progress"]
    failed = progress.get("failed", 0)
    units = f"{progress['total']} units of work"
    if summary["status"] == "completed" and not failed:
        return units
    return f"{progress['done'] - failed} of {units} trained" + (
        f" ({failed} failed)" if failed else ""
    )


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="Interface to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port (0: any free one, as its log says).")] = 8000,
    no_scheduler: Annotated[
        bool, typer.Option("--no-scheduler", help="API only (run `packtune scheduler` apart).")
    ] = False,
) -> None:
    """Serve the API and dashboard; also the scheduler, and packs in-process without Redis.

    The scheduler (with the embedded runner under it) is a child process, not a
    thread, so that its ticks do not hold the API process's GIL. It stops with serve,
    whether that ends by Ctrl-C, SIGTERM or an error, and on its own if serve is
    killed.
    """
    import signal

    import uvicorn

    from service import bus
    from service.db import make_engine, read_only_problem, schema_problem, upgrade
    from service.scheduler_process import SchedulerProcess

    if not 0 <= port <= MAX_PORT:  # before anything starts: uvicorn's bind() raised after
        fail(f"--port must be 0 to {MAX_PORT} (0: any free port), not {port}")
    settings = get_settings()
    if not no_scheduler and settings.redis_url is None:
        _trains_here(settings)  # the embedded runner under its scheduler trains the packs
    _setup_logging()
    if settings.database_url.startswith("sqlite"):
        # its scheduler writes every tick: a read-only file warned every 0.5 s for ever
        problem = None if no_scheduler else read_only_problem(settings.database_url)
        if problem is not None:
            raise SettingsError(problem)
        upgrade(settings.database_url)  # embedded: nothing else would create the file
    else:
        make_engine(settings.database_url).dispose()  # a URL it cannot use: one line, now
        try:  # never migrated: the API answered 500, the scheduler a traceback a tick
            problem = schema_problem(settings.database_url, newer_ok=no_scheduler)
        except StoreUnavailable:  # not up yet: the API says 503, the scheduler waits for it
            problem = None
        if problem is not None:
            fail(problem)
    # uvicorn shuts down on SIGTERM, then puts this handler back and raises SIGTERM again:
    # exit through the ``finally`` below instead of dying at once
    signal.signal(signal.SIGTERM, _exit_on_signal)
    child = None if no_scheduler else SchedulerProcess()
    try:
        if child is not None:
            child.start()
            bus.register(child.wake)  # a study POSTed starts now, not at the next tick
        uvicorn.run(
            "service.api.app:create_app", factory=True, host=host, port=port,
            log_level=settings.log_level.lower(),  # PACKTUNE_LOG_LEVEL=WARNING: no access log
        )  # fmt: skip
    finally:
        if child is not None:
            bus.unregister(child.wake)
            child.stop()


def _exit_on_signal(signum: int, _: object) -> NoReturn:
    raise SystemExit(128 + signum)


@app.command()
def scheduler() -> None:
    """Run the scheduler loop (one per deployment; a second one waits on the lease)."""
    from service.db import read_only_problem, schema_problem
    from service.runtime import run_scheduler
    from service.scheduler_process import stop_on_signals

    url = get_settings().database_url
    problem = read_only_problem(url) or schema_problem(url)
    if problem is not None:
        fail(problem)
    _setup_logging()
    stop = threading.Event()
    stop_on_signals(stop)  # SIGTERM and Ctrl-C: finish the tick, release the lease
    run_scheduler(stop)


@app.command()
def worker(
    gpu: Annotated[
        int | None, typer.Option(help="Pin this worker to GPU N (as nvidia-smi numbers them).")
    ] = None,
    name: Annotated[
        str | None, typer.Option(help="Worker name (default: HOST-gpuN with --gpu, else HOST-PID).")
    ] = None,
    all_gpus: Annotated[
        bool, typer.Option("--all-gpus", help="One worker process per visible GPU.")
    ] = False,
    burst: Annotated[bool, typer.Option(help="Exit when the queue is empty.")] = False,
) -> None:
    """Run an RQ worker that trains packs and sends NVML heartbeats."""
    if gpu is not None and gpu < 0:  # CUDA_VISIBLE_DEVICES=-1 hid every GPU: a CPU worker
        fail(f"--gpu must be a GPU's index (0 or more, as nvidia-smi numbers them), not {gpu}")
    settings = get_settings()
    if not settings.redis_url:
        fail(
            "PACKTUNE_REDIS_URL is not set: a worker takes packs from Redis "
            "(without Redis, `packtune serve` runs packs itself)"
        )
    _setup_logging()
    from worker.main import preflight, run_all_gpus, run_worker

    problem = preflight()
    if problem is not None:
        fail(problem)
    try:
        if all_gpus:
            raise typer.Exit(run_all_gpus(burst=burst))
        run_worker(gpu=gpu, name=name, burst=burst)
    except DeviceUnavailable as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        pass


@app.command()
def check(
    workload: Annotated[str, typer.Argument(help="A registered workload's name.")],
    spec: Annotated[
        Path | None, typer.Option(help="A study spec whose space the members are drawn from.")
    ] = None,
    members: Annotated[int, typer.Option(min=2, max=64, help="Members fused together.")] = 4,
    steps: Annotated[int, typer.Option(min=1, max=1000, help="Steps trained and timed.")] = 5,
    url: Annotated[
        str | None,
        typer.Option(help="Run the check on a service's worker (its device) instead of here."),
    ] = None,
    token: Annotated[
        str | None, typer.Option(envvar="PACKTUNE_API_TOKEN", help="Bearer token (--url).")
    ] = None,
) -> None:
    """Check how WORKLOAD fuses; exit 1 where fusion would be wrong or impossible.

    Its structural and fusible parameters, fused against one by one, the forward each stack
    takes, and the step time for k = 1, 2, 4, 8."""
    need_stdout("the check")
    body = load_spec_file(spec) if spec is not None else None
    if body is not None and body["workload"] != workload:
        fail(f"{spec} is a study of {body['workload']!r}, not {workload!r}")
    space = body["space"] if body is not None else None
    if url is not None:
        report = _remote_check(url, token, workload, space, members, steps)
    else:
        from packtune.workloads import registry

        if workload not in registry():
            fail(f"unknown workload {workload!r}; known: {sorted(registry())}")
        from worker.check import check as run_check
        from worker.check import error_line
        from worker.jobs import pick_device

        device = str(pick_device())
        try:
            found = run_check(workload, space, members=members, steps=steps, device=device)
        except Exception as exc:  # the workload's own code raised: one line, as --url says it
            fail(f"the check could not run: {error_line(exc)}")
        report = found.as_json()
    _print_check(report, members, steps)
    if not report["ok"]:
        raise typer.Exit(1)


def _remote_check(
    url: str, token: str | None, workload: str, space: Any, members: int, steps: int
) -> dict[str, Any]:
    """The check run by a service's worker; a one-line failure where it could not run."""
    from service.remote_cli import connected

    with connected(url, token) as client:
        found = client.check(workload, space, members=members, steps=steps)
    if found["status"] == "error":
        fail(f"the check could not run: {found['error']}")
    return dict(found["report"])


def _print_check(report: dict[str, Any], members: int, steps: int) -> None:
    from rich.table import Table

    from packtune.progress import output_console

    console = output_console()
    console.print(
        f"[bold]{remote_cli.escape(report['workload'])}[/]: "
        f"structural {', '.join(report['structural'])}"
    )
    console.print(f"fusible (may differ inside one array): {', '.join(report['fusible'])}")
    stacks = "; ".join(f"{mode} x{len(keys)}" for keys, mode in report["stacks"])
    console.print(f"{members} members, {steps} steps: stacks {stacks}")
    layers = report.get("layers") or []
    if layers:
        console.print("layers: " + ", ".join(f"{n} {t} ({mode})" for n, t, mode in layers))
    verdict = "exact" if report["exact"] else "[red]NOT exact[/]"
    console.print(f"fused vs one by one: largest parameter difference "
                  f"{report['max_difference']:.3g} ({verdict})")  # fmt: skip
    table = Table("k", "ms per step", "trial-steps/s")
    for k, ms in report["step_ms"].items():
        table.add_row(str(k), f"{ms:.2f}", f"{1000 * int(k) / ms:.0f}" if ms > 0 else "-")
    console.print(table)
    if "spill_problem" in report:  # reports of workers from before these say nothing of it
        spill, decoupled = report["spill_problem"], report["decoupled_problem"]
        console.print("larger than a device: " + (f"cannot spill ({spill})" if spill
                      else "trains spilled, shard by shard"))  # fmt: skip
        console.print("decoupled training: " + (f"not possible ({decoupled})" if decoupled
                      else "possible (training: {mode: decoupled})"))  # fmt: skip
    for line in report["warnings"]:
        console.print(f"[yellow]warning:[/] {remote_cli.escape(line)}")


@db_app.command("upgrade")
def db_upgrade() -> None:
    """Create or migrate the database schema to the newest version."""
    from service.db import upgrade

    settings = get_settings()
    upgrade(settings.database_url)
    typer.echo(f"database at head: {_masked(settings.database_url)}")


remote_cli.register(app)  # submit, studies, show, cancel, delete, export, best


#: set by ``run`` once it has printed its results: nothing is left to do but exit
_run_finished = False


def _exit_now(code: int | str | None) -> NoReturn:
    """End the process without the interpreter's clean-up of every loaded module (~0.25 s
    here: SQLAlchemy, Optuna, rich). Only once ``run`` is done: its database writes are
    committed, its runner is closed and its output is flushed here."""
    if isinstance(code, str):
        typer.echo(code, err=True)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else (0 if code is None else 1))


def main() -> None:
    try:
        # "packtune" in usage and errors however it was started (`python -m service` too)
        app(prog_name="packtune")
    except SystemExit as exc:
        code = 0 if exc.code == 1 and _ended_by_broken_pipe(exc) else exc.code
        if _run_finished:
            _exit_now(code)
        sys.exit(code)
    except SettingsError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except PacktuneError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(1)
    except OSError as exc:
        if not _stdout_broken():
            raise
        # what is still buffered would fail again at exit, as a traceback of its own
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        if isinstance(exc, BrokenPipeError):  # `| head`: the reader has gone
            sys.exit(0)
        typer.echo(f"error: cannot write to standard output: {exc.strerror or exc}", err=True)
        sys.exit(2)


def _ended_by_broken_pipe(exc: SystemExit) -> bool:
    """Whether the libraries under the CLI ended it because standard output's reader had gone
    (`| head`): rich exits 1 from the BrokenPipeError it caught (typer's help; the CLI's own
    output console goes on, so that a failure still exits 1), and click (typer's copy too)
    exits 1 with the streams wrapped so that their last flush is quiet. A reader leaving early
    is not the command failing: exit 0, as the branch below does for what they let through."""
    if isinstance(exc.__context__, BrokenPipeError):
        return True
    return type(sys.stdout).__name__.lstrip("_") == "PacifyFlushWrapper"


def _stdout_broken() -> bool:
    """Whether standard output cannot be written (a full disk, a closed pipe): a table
    printed to ``/dev/full`` was a traceback. Probed with a line end, the least a healthy
    output can take (a failed write may have left nothing buffered to flush again)."""
    try:
        sys.stdout.write("\n")
        sys.stdout.flush()
    except OSError:
        return True
    return False


if __name__ == "__main__":
    main()
